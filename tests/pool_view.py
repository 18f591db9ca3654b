"""The live pool's picture of one block, in the shape a Mirror answers (wire/views.BlockView): for
tests that compare what the events rebuild with the engine's own pool."""
from __future__ import annotations

from kvplay.wire.views import BlockView


def block_view(pool, bid: int) -> BlockView:
    b = pool.blocks[bid]
    h = b.hash
    return BlockView(bid, b.state, b.ref_count, None if h is None else pool.hex(h), b.creator, b.creator_request,
                     b.token_ids, b.hits, b.created_at, b.last_used, tuple(sorted(b.users_seen)))

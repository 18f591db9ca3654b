"""The live pool's picture of one block, in the shape a Mirror answers (wire/views.BlockView): for
tests that compare what the events rebuild with the engine's own pool."""
from __future__ import annotations

from kvplay.wire.views import BlockArrays, BlockView, summarize


def block_view(pool, bid: int) -> BlockView:
    b = pool.blocks[bid]
    h = b.hash
    return BlockView(bid, b.state, b.ref_count, None if h is None else pool.hex(h), b.creator, b.creator_request,
                     b.token_ids, b.hits, b.created_at, b.last_used, tuple(sorted(b.users_seen)))


def pool_summary(pool, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
    """The live pool's blocks [start, stop) in `cells` equal runs (as a Mirror's `summary`)."""
    start, stop, _ = slice(start, stop).indices(pool.num_blocks)
    arrays = BlockArrays(0, start, pool.state_codes()[start:stop].copy(), pool.creator_codes()[start:stop].copy(),
                         tuple(pool.users))
    return summarize(arrays, cells, user)

"""A watched server's batches as kvplay engine events (sessions/watch_recording.py records them
into the sessions DB, like any other session: source "watch").

The mirror journals what each batch did (wire/mirror.py); this turns the journal into kvplay's
engine events, so the recorded session reads like one of our own engine's: a new block is a
`BlockStored` (one per block, `user` = the session that stored it), a re-announced block
(vLLM's kv_cache_report_mode "full") is a `BlockHit` of the reusing session with `by_creator`,
an eviction a `BlockRemoved` with its creator, a reset or a publisher restart an
`AllBlocksCleared` (reason "cleared" / "publisher restarted"). Hashes are stored as hex.

Each row also gets the `pod` and the batch's `wire_seq`; `seq` is the order events were applied
in, across pods. Rows are written in one transaction per `flush()` (the watch loop flushes about
once a second and at the end), so a busy server costs one commit a second, not one per batch.
"""
from __future__ import annotations

from kvplay.engine.events import AllBlocksCleared, BlockHit, BlockRemoved, BlockStored

from .codec import hash_hex


def journal_events(journal: list, ts: float) -> list:
    """A mirror's journal entries (wire/mirror.py) as kvplay engine events, in order: new blocks
    continuing one chain for one session are one BlockStored, consecutive re-announcements for one
    session one BlockHit (`by_creator` in tokens), consecutive evictions one BlockRemoved (its
    `creators` index-aligned with the hashes, "" when unknown), a reset or restart an
    AllBlocksCleared."""
    out = []
    hits = None
    for entry in journal:
        kind = entry[0]
        if kind == "hit":
            _, h, who, creator, size = entry
            if hits is None or hits.user != who:
                hits = BlockHit(ts=ts, user=who, block_hashes=[], cached_tokens=0, by_creator={})
                out.append(hits)
            hits.block_hashes.append(hash_hex(h))
            hits.cached_tokens += size
            hits.by_creator[creator] = hits.by_creator.get(creator, 0) + size
            continue
        hits = None
        last = out[-1] if out else None
        if kind == "stored":
            _, h, parent, tokens, size, who = entry
            hp = hash_hex(parent)
            if (type(last) is BlockStored and last.user == who and last.block_size == size
                    and last.block_hashes[-1] == hp):  # the chain goes on: one event, like vLLM's
                last.block_hashes.append(hash_hex(h))
                last.token_ids.extend(tokens)
            else:
                out.append(BlockStored(ts=ts, block_hashes=[hash_hex(h)], parent_block_hash=hp,
                                       token_ids=list(tokens), block_size=size, user=who))
        elif kind == "removed":
            _, h, creator = entry
            if type(last) is BlockRemoved:
                last.block_hashes.append(hash_hex(h))
                last.creators.append(creator or "")
            else:
                out.append(BlockRemoved(ts=ts, block_hashes=[hash_hex(h)], creators=[creator or ""]))
        else:
            out.append(AllBlocksCleared(ts=ts, reason=entry[1]))
    return out

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

_U64 = 0xFFFFFFFFFFFFFFFF  # hash_hex of an int, inlined on this hot path


def journal_events(journal: list, ts: float) -> list:
    """A mirror's journal entries (wire/mirror.py) as kvplay engine events, in order: new blocks
    continuing one chain for one session are one BlockStored, consecutive re-announcements for one
    session one BlockHit (`by_creator` in tokens), consecutive evictions one BlockRemoved (its
    `creators` index-aligned with the hashes, "" when unknown), a reset or restart an
    AllBlocksCleared."""
    out = []
    hits = None
    chain = None  # the BlockStored the last entry extended, and that entry's raw hash
    chain_h = None
    removed = None
    for entry in journal:
        kind = entry[0]
        if kind == "stored":
            _, h, parent, tokens, size, who = entry
            hx = format(h & _U64, "016x") if type(h) is int else hash_hex(h)
            if chain is not None and parent == chain_h and chain.user == who and chain.block_size == size:
                chain.block_hashes.append(hx)  # the chain goes on: one event, like vLLM's
                chain.token_ids.extend(tokens)
            else:
                hp = None if parent is None else (
                    format(parent & _U64, "016x") if type(parent) is int else hash_hex(parent))
                chain = BlockStored(ts=ts, block_hashes=[hx], parent_block_hash=hp, token_ids=list(tokens),
                                    block_size=size, user=who)
                out.append(chain)
            chain_h = h
            hits = removed = None
        elif kind == "hit":
            _, h, who, creator, size = entry
            if hits is None or hits.user != who:
                hits = BlockHit(ts=ts, user=who, block_hashes=[], cached_tokens=0, by_creator={})
                out.append(hits)
            hits.block_hashes.append(format(h & _U64, "016x") if type(h) is int else hash_hex(h))
            hits.cached_tokens += size
            hits.by_creator[creator] = hits.by_creator.get(creator, 0) + size
            chain = removed = None
        elif kind == "removed":
            _, h, creator = entry
            hx = format(h & _U64, "016x") if type(h) is int else hash_hex(h)
            if removed is None:
                removed = BlockRemoved(ts=ts, block_hashes=[hx], creators=[creator or ""])
                out.append(removed)
            else:
                removed.block_hashes.append(hx)
                removed.creators.append(creator or "")
            chain = hits = None
        else:
            out.append(AllBlocksCleared(ts=ts, reason=entry[1]))
            chain = hits = removed = None
    return out

"""Glue: kvplay's own engine events (live, or recorded as dicts) into Mirrors, for the views that
read a Mirror (the prefix tree). One class, `EngineFeed`; meant to be replaced by the one event
stream every view reads (ARCHITECTURE.md) when that lands.

What the Mirror does not keep and a view of kvplay's own engine wants is kept here: the block
id each hash sits in (`block_id`, so a node's blocks light up on the block map) and each block's
hits (BlockHit events, per hash). A BlockHit re-announces its blocks to the mirror for the
reusing user (like vLLM's kv_cache_report_mode "full"), so they join the blocks' holders.
Events of several pods (an attached fleet's recording) go to a Mirror per pod.
"""
from __future__ import annotations

from .codec import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from .mirror import Mirror

MAX_EVENT_BLOCKS = 1 << 16  # blocks one recorded event may name; a bigger one is counted and skipped


def _get(ev, name, default=None):
    return ev.get(name, default) if isinstance(ev, dict) else getattr(ev, name, default)


class EngineFeed:
    """Mirrors (one per pod; pod None is the local engine) fed kvplay engine events in order."""

    def __init__(self):
        self.mirrors: dict = {}
        self.block_id: dict = {}   # (pod, hash) -> block id, for events that carry block ids
        self.key_at: dict = {}     # block id -> (pod, hash): the other way
        self.hits: dict = {}       # pod -> {hash: hits}
        self.bad = 0               # events skipped as malformed
        self.version = 0

    def mirror(self, pod=None) -> Mirror:
        m = self.mirrors.get(pod)
        if m is None:
            m = self.mirrors[pod] = Mirror(str(pod) if pod is not None else "local")
            self.hits[pod] = {}
        return m

    def apply(self, ev) -> None:
        """One engine event (an `engine.events` object or its recorded dict); a malformed one is
        counted in `bad` and skipped."""
        try:
            self._apply(ev)
        except (TypeError, ValueError, AttributeError, KeyError):
            self.bad += 1

    def _apply(self, ev) -> None:
        kind = ev.get("kind") if isinstance(ev, dict) else type(ev).__name__
        if kind not in ("BlockStored", "BlockHit", "BlockRemoved", "AllBlocksCleared"):
            return
        pod = _get(ev, "pod")
        m = self.mirror(pod)
        ts = float(_get(ev, "ts") or 0.0)
        hashes = list(_get(ev, "block_hashes") or ())
        if len(hashes) > MAX_EVENT_BLOCKS or not all(isinstance(h, str) for h in hashes):
            self.bad += 1
            return
        ids = list(_get(ev, "block_ids") or ())
        hits = self.hits[pod]
        user = _get(ev, "user") or None
        if kind == "BlockStored":
            tokens = [int(t) for t in (_get(ev, "token_ids") or ())]
            size = int(_get(ev, "block_size") or (len(tokens) // max(1, len(hashes))))
            parent = _get(ev, "parent_block_hash")
            wire = BlockStored(hashes, parent if isinstance(parent, str) else None, tokens, size,
                               medium=MEDIUM_GPU, session_id=user)
            for h, b in zip(hashes, ids):
                old = self.block_id.get((pod, h))
                if old is not None:
                    self.key_at.pop(old, None)
                self.block_id[(pod, h)] = b
                self.key_at[b] = (pod, h)
            for h in hashes:
                hits.pop(h, None)
        elif kind == "BlockHit":
            present = [h for h in hashes if h in m.blocks]
            if not present:
                return
            for h in present:
                hits[h] = hits.get(h, 0) + 1
            wire = BlockStored(present, None, [], 0, medium=MEDIUM_GPU, session_id=user)
        elif kind == "BlockRemoved":
            for h in hashes:
                b = self.block_id.pop((pod, h), None)
                if b is not None and self.key_at.get(b) == (pod, h):
                    del self.key_at[b]
                hits.pop(h, None)
            wire = BlockRemoved(hashes, MEDIUM_GPU)
        else:
            for k in [k for k in self.block_id if k[0] == pod]:
                b = self.block_id.pop(k)
                if self.key_at.get(b) == k:
                    del self.key_at[b]
            hits.clear()
            wire = AllBlocksCleared()
        m.apply(EventBatch(ts, [wire]))
        self.version += 1

    def block_ids(self, pod, keys) -> list[int]:
        """The block ids (map cells) of mirror keys, those known."""
        out = []
        for k in keys:
            b = self.block_id.get((pod, k))
            if b is not None:
                out.append(b)
        return out

    def key_of(self, block_id: int):
        """(pod, hash) of the block in `block_id`, or None."""
        return self.key_at.get(block_id)


def feed_events(events, n: int | None = None) -> EngineFeed:
    """An EngineFeed with recorded events 0..n-1 applied (all when n is None)."""
    feed = EngineFeed()
    for e in events[:len(events) if n is None else max(0, n)]:
        feed.apply(e)
    return feed

"""Record a watched server into the sessions DB, like any other session (source "watch").

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
from kvplay.sessions.recorder import Recorder

from .codec import hash_hex
from .mirror import Fleet


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


class WatchRecording:
    def __init__(self, db_path: str | None, fleet: Fleet, title: str | None = None, model: str = "remote"):
        self.rec = Recorder.open(db_path, None, model, "watch", "", title=title)
        self.session_id = self.rec.session_id
        self.path = self.rec.path
        self.fleet = fleet
        self._seq = 0
        self._events: list = []
        self._cols: list = []
        self.recorded = 0

    def watch(self, pod: str) -> None:
        """Start journaling `pod`'s mirror."""
        m = self.fleet.pod(pod)
        if m.journal is None:
            m.journal = []

    def on_batch(self, pod: str, wire_seq: int, ts: float) -> None:
        """Turn what the pod's last batch did into events (called after each applied batch)."""
        m = self.fleet.pod(pod)
        journal = m.journal
        if not journal:
            return
        m.journal = []
        cols = {"pod": pod, "wire_seq": wire_seq}
        for ev in journal_events(journal, ts):
            self._seq += 1
            ev.seq = self._seq
            self._events.append(ev)
            self._cols.append(cols)

    def flush(self) -> None:
        if not self._events:
            return
        events, cols = self._events, self._cols
        self._events, self._cols = [], []
        self.rec.record_events(events, cols)
        self.recorded += len(events)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.rec.close()

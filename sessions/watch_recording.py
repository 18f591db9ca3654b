"""Record a watched server into the sessions DB, like any other session (source "watch"): each
applied batch as kvplay engine events — what the pod's `FromWire` translated it to (the one
translator, wire/translate.py) — one `event_batches` row per batch with its `pod` and `wire_seq`.
A batch is encoded as it arrives (its events die young: holding a second's worth of event objects
for the writer made the garbage collector the biggest cost of recording) and the rows are written
in one transaction per `flush()` (the watch loop flushes about once a second and at the end), or
as soon as `FLUSH_EVENTS` events wait, so memory stays bounded and nothing is dropped. Hashes are
as the server sent them; the block ids are each pod's own slots, so a reader names a recorded
pod's blocks by pod and hash (sessions/event_log.py)."""
from __future__ import annotations

from kvplay.engine.events import EngineBatch

from .event_log import batch_row
from .recorder import Recorder

FLUSH_EVENTS = 65_536  # events waiting beyond this are written at once (bounded memory)


class WatchRecording:
    def __init__(self, db_path: str | None, title: str | None = None, model: str = "remote"):
        self.rec = Recorder.open(db_path, None, model, "watch", "", title=title)
        self.session_id = self.rec.session_id
        self.path = self.rec.path
        self._seq = 0
        self._rows: list[tuple] = []  # encoded batches waiting for `flush`
        self._pending = 0             # their events
        self.recorded = 0

    def on_batch(self, pod: str, wire_seq: int, batch: EngineBatch) -> None:
        """Encode one applied batch (the engine batch its pod's mirror applied) as a row to write."""
        events = batch.events
        if not events:
            return
        seq = self._seq
        for ev in events:  # numbered in the session's order (each pod's translator counts its own)
            seq += 1
            ev.seq = seq
        self._seq = seq
        self._rows.append(batch_row(self.session_id, EngineBatch(batch.step, batch.ts, events, pod=pod,
                                                                 wire_seq=wire_seq)))
        self._pending += len(events)
        if self._pending >= FLUSH_EVENTS:
            self.flush()

    def on_restart(self, pod: str, batch: EngineBatch) -> None:
        """The pod's publisher restarted: its cache is gone (the clear its mirror applied)."""
        self.on_batch(pod, -1, batch)

    def flush(self) -> None:
        """Write the rows waiting, in one transaction."""
        if not self._rows:
            return
        rows, n = self._rows, self._pending
        self._rows, self._pending = [], 0
        self.rec.write_rows(rows, n)
        self.recorded += n

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.rec.close()

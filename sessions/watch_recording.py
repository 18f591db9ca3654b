"""Record a watched server into the sessions DB, like any other session (source "watch"): each
applied batch as kvplay engine events — what the pod's `Mirror.apply_wire` converted it to (the
one converter, wire/mirror.py) — one `event_batches` row per batch with its `pod` and `wire_seq`.
A batch is encoded as it arrives (its events die young: holding a second's worth of event objects
for the writer made the garbage collector the biggest cost of recording) and the rows are written
in one transaction per `flush()` (the watch loop flushes about once a second and at the end), or
as soon as `FLUSH_EVENTS` events wait, so memory stays bounded and nothing is dropped. Hashes are
hex; block ids are left out (each pod numbers its own slots: the recording names blocks by pod
and hash)."""
from __future__ import annotations

import time

from kvplay.engine.events import AllBlocksCleared
from kvplay.wire.mirror import Fleet

from .event_log import batch_row
from .recorder import Recorder

FLUSH_EVENTS = 65_536  # events waiting beyond this are written at once (bounded memory)


class WatchRecording:
    def __init__(self, db_path: str | None, fleet: Fleet, title: str | None = None, model: str = "remote"):
        self.rec = Recorder.open(db_path, None, model, "watch", "", title=title)
        self.session_id = self.rec.session_id
        self.path = self.rec.path
        self.fleet = fleet
        self._seq = 0
        self._rows: list[tuple] = []  # encoded batches waiting for `flush`
        self._pending = 0             # their events
        self.recorded = 0

    def watch(self, pod: str) -> None:
        """Record `pod`: its mirror converts what it applies into engine events."""
        self.fleet.pod(pod).convert = True

    def on_batch(self, pod: str, wire_seq: int, events: list) -> None:
        """Encode one applied batch's engine events (its `Applied.events`) as a row to write."""
        if not events:
            return
        seq = self._seq
        for ev in events:
            seq += 1
            ev.seq = seq
            if hasattr(ev, "block_ids"):
                ev.block_ids = []
        self._seq = seq
        self._rows.append(batch_row(self.session_id, events, pod=pod, wire_seq=wire_seq))
        self._pending += len(events)
        if self._pending >= FLUSH_EVENTS:
            self.flush()

    def on_restart(self, pod: str) -> None:
        """The pod's publisher restarted: its cache is gone (an AllBlocksCleared)."""
        self.on_batch(pod, -1, [AllBlocksCleared(ts=time.time(), reason="publisher restarted")])

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

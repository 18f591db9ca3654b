"""Record a watched server into the sessions DB, like any other session (source "watch"): each
applied batch as kvplay engine events — what the pod's `Mirror.apply_wire` converted it to (the
one converter, wire/mirror.py) — written with the batch's `pod` and `wire_seq` in one transaction
per `flush()` (the watch loop flushes about once a second and at the end), so a busy server costs
one commit a second, not one per batch. Hashes are hex; block ids are left out (each pod numbers
its own slots: the recording names blocks by pod and hash)."""
from __future__ import annotations

import time

from kvplay.engine.events import AllBlocksCleared
from kvplay.wire.mirror import Fleet

from .recorder import Recorder


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
        """Record `pod`: its mirror converts what it applies into engine events."""
        self.fleet.pod(pod).convert = True

    def on_batch(self, pod: str, wire_seq: int, events: list) -> None:
        """Queue one applied batch's engine events (its `Applied.events`)."""
        cols = {"pod": pod, "wire_seq": wire_seq}
        for ev in events:
            self._seq += 1
            ev.seq = self._seq
            if hasattr(ev, "block_ids"):
                ev.block_ids = []
            self._events.append(ev)
            self._cols.append(cols)

    def on_restart(self, pod: str) -> None:
        """The pod's publisher restarted: its cache is gone (an AllBlocksCleared)."""
        self.on_batch(pod, -1, [AllBlocksCleared(ts=time.time(), reason="publisher restarted")])

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

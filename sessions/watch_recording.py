"""Record a watched server into the sessions DB, like any other session (source "watch"): each
applied batch's mirror journal becomes engine events (wire/recording.journal_events), written
with the batch's `pod` and `wire_seq` in one transaction per `flush()`."""
from __future__ import annotations

from kvplay.wire.mirror import Fleet
from kvplay.wire.recording import journal_events

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

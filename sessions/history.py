"""A recorded session's cache history: the block pool as it stood after any recorded event.

A recording is read back as typed batches (sessions/event_log.py: `EngineBatch`es with their
envelope); events are counted across them, in order. `pool_state(batches, n, num_blocks)`
applies events 0..n-1 to an empty `Mirror` (wire/mirror.py: the one mirror every cache view
reads) and returns it with the counters the app shows. `History` adds checkpoints so that scrubbing back and forth through a long session stays
cheap: a seek replays at most a checkpoint's spacing of events, and a checkpoint copies the
mirror's arrays only up to the highest block the session used, so opening or seeking a session
recorded on a 1,000,000-block pool costs what its events cost, not the pool.

Recordings made before the engine emitted BlocksAllocated/Touched/Released show a block
allocated but not yet full as free until it is stored (wire/mirror.py says how in-use is then
inferred); newer ones equal the live pool after every event.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

from kvplay.engine.events import EngineBatch, Event, RequestFinished
from kvplay.wire.mirror import MAX_BLOCKS, Mirror
from kvplay.wire.views import BlockView

from .event_log import read_batches
from .query import resolve_session, session_turns, session_users, with_misses
from .store import StoreError

CHECKPOINT_BYTES = 256 << 20  # all checkpoints of one History together, at most about this
_SLOT_BYTES = 31  # bytes per slot of a Mirror's arrays


@dataclass
class PoolState:
    """The pool and counters after `applied` events. `mirror` is the History's cursor: it is
    this state until the next `History.state` call moves it."""
    applied: int
    mirror: Mirror
    hit: frozenset  # blocks the latest request reused
    hit_tokens: int
    query_tokens: int
    evictions: int
    preemptions: int
    running: int
    waiting: int
    ts: float | None  # wall clock of the last applied event

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def num_blocks(self) -> int:
        return self.mirror.num_blocks

    @property
    def blocks(self) -> tuple[BlockView, ...]:
        """Every block as a BlockView: O(pool), for tests and small pools (views use `mirror`)."""
        return self.mirror.views()

    def count(self, state: str) -> int:
        return self.mirror.count(state)


def _state(m: Mirror) -> PoolState:
    return PoolState(m.applied, m, m.hit, m.hit_tokens, m.query_tokens, m.evictions, m.preemptions,
                     len(m.running), len(m.waiting), m.ts)


def apply_events(m: Mirror, batches: list[EngineBatch], n: int, ends: list[int] | None = None) -> None:
    """Apply recorded events m.applied..n-1 of `batches` to `m` (events counted across the
    batches, in order; `ends`: the running event counts of the batches, `event_ends`)."""
    ends = event_ends(batches) if ends is None else ends
    while m.applied < n:
        k = bisect.bisect_right(ends, m.applied)  # the batch holding event number m.applied
        start = m.applied - (ends[k - 1] if k else 0)
        m.apply(batches[k], start, min(n - m.applied + start, len(batches[k].events)))


def event_ends(batches: list[EngineBatch]) -> list[int]:
    """How many events the batches hold up to and including each one."""
    return list(accumulate(len(b.events) for b in batches))


def flat_events(batches: list[EngineBatch]) -> list[Event]:
    """The batches' events in order (what a cursor over events counts)."""
    return [e for b in batches for e in b.events]


def pool_state(batches: list[EngineBatch], n: int, num_blocks: int) -> PoolState:
    """The pool after applying the recorded events 0..n-1 of `batches`."""
    m = Mirror(num_blocks)
    apply_events(m, batches, max(0, n))
    return _state(m)


class History:
    """`pool_state` for a cursor that moves back and forth. Checkpoints (mirror copies) every
    `every` events, spaced further apart when the mirror is big, so that all of them together
    stay under CHECKPOINT_BYTES; forward moves apply to the cursor's mirror, no copy."""

    def __init__(self, batches: list[EngineBatch], num_blocks: int, every: int = 256):
        self.batches = batches
        self._ends = event_ends(batches)
        self.num_blocks = num_blocks
        self.every = every
        self._marks: list[int] = [0]
        self._saved: list[Mirror] = [Mirror(num_blocks)]
        self._cur = Mirror(num_blocks)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _room(self, m: Mirror) -> int:
        return max(4, CHECKPOINT_BYTES // (max(16, m.hw) * _SLOT_BYTES))

    def state(self, n: int) -> PoolState:
        n = max(0, min(n, len(self)))
        i = bisect.bisect_right(self._marks, n) - 1
        r = self._cur
        if not (self._marks[i] <= r.applied <= n):
            r = self._saved[i].copy()
        self._cur = r
        while r.applied < n:
            target = self._marks[-1] + self.every  # the next checkpoint, once the cursor passes it
            apply_events(r, self.batches, min(n, target) if target > r.applied else r.applied + 1, self._ends)
            if r.applied - self._marks[-1] >= self.every and r.applied > self._marks[-1]:
                if len(self._marks) >= self._room(r):  # thin out: keep every other, double the spacing
                    self._marks, self._saved = self._marks[::2], self._saved[::2]
                    self.every *= 2
                    continue
                self._marks.append(r.applied)
                self._saved.append(r.copy())
        return _state(r)


# --- loading a recorded session (no engine, no model) ---------------------------------------------
def session_batches(db, sid: str) -> list[EngineBatch]:
    """The recorded batches of a session in order, each its events and envelope (`forwards`: the
    engine's step clock, None for sessions recorded before kvplay kept it; `pod` for a watched
    server). Rows of either recording format (sessions/event_log.py); a damaged row or event is
    skipped."""
    return read_batches(db, sid)[0]


def recorded_pool_size(session: dict, batches: list[EngineBatch]) -> int | None:
    """How many blocks the session's pool had: its config, else its final stats, else at least
    every block its events name."""
    n = (session.get("engine_config") or {}).get("num_blocks") or (session.get("stats") or {}).get("blocks_total")
    if type(n) is not int or not 0 < n <= MAX_BLOCKS:  # missing, or not a pool a mirror can hold
        n = None
    if n is None and batches:  # every block the events name
        r = Mirror(0)
        for b in batches:
            r.apply(b)
        n = r.hw
    return n or None


def turn_ends(rec: "Recording") -> list[int]:
    """The event counts at which each recorded request finished (the scrubber's turn marks)."""
    return [i + 1 for i, e in enumerate(rec.events) if type(e) is RequestFinished]


@dataclass
class Recording:
    """Everything the scrubber shows of one recorded session."""
    session: dict
    users: list[dict]
    turns: list[dict]
    batches: list[EngineBatch]
    num_blocks: int

    def __post_init__(self):
        self.events = flat_events(self.batches)  # the cursor counts these

    @property
    def id(self) -> str:
        return self.session["id"]


def load_recording(db, ident: str) -> Recording:
    s = resolve_session(db, ident)
    batches = session_batches(db, s["id"])
    if not batches:
        raise StoreError(f"session {s['id']} has no recorded cache events to scrub through")
    n = recorded_pool_size(s, batches) or 1
    events = flat_events(batches)
    return Recording(s, session_users(db, s["id"]), with_misses(db, s["id"], session_turns(db, s["id"]), events),
                     batches, n)

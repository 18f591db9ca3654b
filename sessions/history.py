"""A recorded session's cache history: the block pool as it stood after any recorded event.

`pool_state(events, n, num_blocks)` is the one pure function: it applies events 0..n-1 to an
empty pool, the way the engine's BlockPool changed when it emitted them, and returns every
block's state (free / cached / in use), hash, creator, tokens, hits and users, plus the
counters the app shows. `History` adds checkpoints so that scrubbing back and forth through
a long session stays cheap; its states equal `pool_state`'s.

Events without block ids (a watched server's: vLLM's wire names blocks by hash only) get a slot
per (pod, hash): the lowest free one when stored, freed when removed or when the pod's cache is
cleared, so the map shows that server's cache as it filled and emptied.

What the events cannot show: a block allocated but not yet full (the tail of a running
request) and the blocks a preempted request re-references when it is re-admitted emit nothing,
so they read as free (or cached) until the request stores or releases them. With no request
running (between turns of a sequential session) the state equals the live pool's.
"""
from __future__ import annotations

import bisect
import copy
import heapq
import json
from dataclasses import dataclass, field

from kvplay.engine.observe import BlockView  # the block map reads recorded and live blocks alike
from kvplay.engine.pool import CACHED, FREE, IN_USE


@dataclass
class _Block:
    holders: set = field(default_factory=set)  # request ids holding it
    indexed: bool = False
    hash: str | None = None
    creator: str | None = None
    creator_request: str | None = None
    token_ids: tuple = ()
    hits: int = 0
    created_at: float = 0.0
    last_used: float = 0.0
    users: set = field(default_factory=set)

    def reset(self) -> None:
        self.indexed, self.hash, self.creator, self.creator_request = False, None, None, None
        self.token_ids, self.hits, self.users = (), 0, set()

    @property
    def state(self) -> str:
        return IN_USE if self.holders else (CACHED if self.indexed else FREE)


@dataclass
class PoolState:
    """The pool and counters after `applied` events."""
    applied: int
    blocks: tuple[BlockView, ...]
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

    def count(self, state: str) -> int:
        return sum(1 for b in self.blocks if b.state == state)


class _Replayer:
    """Mutable pool state that events are applied to, in order."""

    def __init__(self, num_blocks: int):
        self.blocks = [_Block() for _ in range(num_blocks)]
        self.held: dict[str, list[int]] = {}
        self.prompt: dict[str, int] = {}
        self.started: set[str] = set()
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.hit: frozenset = frozenset()
        self.hit_tokens = self.query_tokens = self.evictions = self.preemptions = 0
        self.applied = 0
        self.ts: float | None = None
        self.slot_of: dict[tuple, int] = {}  # (pod, hash) -> slot, for events without block ids
        self.free_slots: list[int] = []  # a heap of freed slots
        self.next_slot = 0

    def _ids(self, e: dict, store: bool = False) -> list[int]:
        """The blocks an event names: its block ids, else one slot per (pod, hash)."""
        ids = e.get("block_ids")
        if ids:
            return ids
        pod = e.get("pod")
        out = []
        for h in e.get("block_hashes") or []:
            slot = self.slot_of.get((pod, h))
            if slot is None and store:
                if self.free_slots:
                    slot = heapq.heappop(self.free_slots)
                else:
                    slot, self.next_slot = self.next_slot, self.next_slot + 1
                self.slot_of[(pod, h)] = slot
            if slot is not None:
                out.append(slot)
        return out

    def _drop_slots(self, pod, hashes=None) -> None:
        keys = [k for k in self.slot_of if k[0] == pod] if hashes is None else [(pod, h) for h in hashes]
        for k in keys:
            slot = self.slot_of.pop(k, None)
            if slot is not None:
                heapq.heappush(self.free_slots, slot)

    def _block(self, b: int) -> _Block:
        while b >= len(self.blocks):  # a session whose pool size was not recorded
            self.blocks.append(_Block())
        return self.blocks[b]

    def _release(self, rid: str, ts: float) -> None:
        for b in self.held.pop(rid, []):
            blk = self._block(b)
            blk.holders.discard(rid)
            blk.last_used = ts
            if not blk.holders and not blk.indexed:
                blk.reset()

    def apply(self, e: dict) -> None:
        kind, rid, ts = e.get("kind"), e.get("request_id") or "", e.get("ts") or 0.0
        self.applied += 1
        self.ts = ts or self.ts
        if kind == "BlockStored":
            hashes = e.get("block_hashes") or []
            tokens = e.get("token_ids") or []
            bs = e.get("block_size") or (len(tokens) // max(1, len(hashes)))
            for i, b in enumerate(self._ids(e, store=True)):
                blk = self._block(b)
                blk.reset()
                blk.indexed = True
                blk.hash = hashes[i] if i < len(hashes) else None
                blk.creator, blk.creator_request = e.get("user") or None, rid or None
                blk.token_ids = tuple(tokens[i * bs:(i + 1) * bs])
                blk.created_at = blk.last_used = ts
                blk.users = {e["user"]} if e.get("user") else set()
                if rid:
                    blk.holders.add(rid)
                    self.held.setdefault(rid, []).append(b)
        elif kind == "BlockHit":
            hit = self._ids(e)
            self.hit = frozenset(hit)
            self.hit_tokens += e.get("cached_tokens") or 0
            for b in hit:
                blk = self._block(b)
                blk.hits += 1
                blk.last_used = ts
                if e.get("user"):
                    blk.users.add(e["user"])
                if rid and rid not in blk.holders:
                    blk.holders.add(rid)
                    self.held.setdefault(rid, []).append(b)
        elif kind == "BlockRemoved":
            ids = self._ids(e)
            if not e.get("block_ids"):
                self._drop_slots(e.get("pod"), e.get("block_hashes") or [])
            if e.get("reason", "evicted") == "evicted":
                self.evictions += len(ids)
            for b in ids:
                blk = self._block(b)
                blk.indexed = False
                if not blk.holders:
                    blk.reset()
        elif kind == "AllBlocksCleared":
            self.hit = frozenset()
            pod = e.get("pod")
            if any(k[0] == pod for k in self.slot_of):  # a server's reset names no blocks: all of the pod's go
                for slot in [v for k, v in self.slot_of.items() if k[0] == pod]:
                    blk = self._block(slot)
                    blk.indexed = False
                    if not blk.holders:
                        blk.reset()
                self._drop_slots(pod)
        elif kind == "RequestQueued":
            self.prompt[rid] = e.get("prompt_tokens") or 0
            self.waiting.add(rid)
        elif kind == "RequestStarted":
            if rid not in self.started:
                self.started.add(rid)
                self.query_tokens += self.prompt.get(rid, 0)
                if not e.get("cached_tokens"):
                    self.hit = frozenset()
            self.waiting.discard(rid)
            self.running.add(rid)
        elif kind == "RequestPreempted":
            self.preemptions += 1
            self._release(rid, ts)
            self.running.discard(rid)
            self.waiting.add(rid)
        elif kind == "RequestFinished":
            self._release(rid, ts)
            self.running.discard(rid)
            self.waiting.discard(rid)

    def state(self) -> PoolState:
        views = tuple(BlockView(i, b.state, len(b.holders), b.hash, b.creator, b.creator_request, b.token_ids,
                                b.hits, b.created_at, b.last_used, tuple(sorted(b.users)))
                      for i, b in enumerate(self.blocks))
        return PoolState(self.applied, views, self.hit, self.hit_tokens, self.query_tokens, self.evictions,
                         self.preemptions, len(self.running), len(self.waiting), self.ts)


def pool_state(events: list[dict], n: int, num_blocks: int) -> PoolState:
    """The pool after applying recorded events 0..n-1 (event dicts as the recorder stores them)."""
    r = _Replayer(num_blocks)
    for e in events[:max(0, n)]:
        r.apply(e)
    return r.state()


class History:
    """`pool_state` for a cursor that moves back and forth: a copy of the state every `every`
    events, so a seek replays at most `every` events."""

    def __init__(self, events: list[dict], num_blocks: int, every: int = 256):
        self.events = events
        self.num_blocks = num_blocks
        self.every = every
        self._marks: list[int] = [0]
        self._saved: list[_Replayer] = [_Replayer(num_blocks)]
        self._cur = _Replayer(num_blocks)  # stepping forward applies to this one, no copy

    def __len__(self) -> int:
        return len(self.events)

    def state(self, n: int) -> PoolState:
        n = max(0, min(n, len(self.events)))
        i = bisect.bisect_right(self._marks, n) - 1
        if self._cur.applied <= n and self._cur.applied >= self._marks[i]:
            r = self._cur
        else:
            r = copy.deepcopy(self._saved[i])
        self._cur = r
        while r.applied < n:
            r.apply(self.events[r.applied])
            if r.applied % self.every == 0 and r.applied > self._marks[-1]:
                self._marks.append(r.applied)
                self._saved.append(copy.deepcopy(r))
        return r.state()


# --- loading a recorded session (no engine, no model) ---------------------------------------------
def session_events(db, sid: str) -> list[dict]:
    """The recorded events of a session in order: each its payload plus `forwards`, the engine's
    step clock when it was emitted (None for sessions recorded before kvplay kept it)."""
    out = []
    for r in db.query("select * from cache_events where session_id = ? order by seq, id", [sid]):
        d = json.loads(r["payload"])
        d["forwards"] = r.get("forwards")
        if r.get("pod") is not None:  # a watched server's pod
            d["pod"] = r["pod"]
        out.append(d)
    return out


def recorded_pool_size(session: dict, events: list[dict]) -> int | None:
    """How many blocks the session's pool had: its config, else its final stats, else at least
    every block its events name."""
    n = (session.get("engine_config") or {}).get("num_blocks") or (session.get("stats") or {}).get("blocks_total")
    if n is None and events:
        n = 1 + max((b for e in events for b in (e.get("block_ids") or [])), default=-1)
        if n <= 0:  # blocks named by hash only: as many as were ever cached at once
            r = _Replayer(0)
            for e in events:
                r.apply(e)
            n = r.next_slot
    return int(n) if n else None


@dataclass
class Recording:
    """Everything the scrubber shows of one recorded session."""
    session: dict
    users: list[dict]
    turns: list[dict]
    events: list[dict]
    num_blocks: int

    @property
    def id(self) -> str:
        return self.session["id"]


def load_recording(db, ident: str) -> Recording:
    from .query import resolve_session, session_turns, session_users
    from .store import StoreError

    s = resolve_session(db, ident)
    events = session_events(db, s["id"])
    if not events:
        raise StoreError(f"session {s['id']} has no recorded cache events to scrub through")
    n = recorded_pool_size(s, events) or 1
    return Recording(s, session_users(db, s["id"]), session_turns(db, s["id"]), events, n)

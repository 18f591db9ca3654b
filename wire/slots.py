"""A block pool as its events describe it: numpy slot arrays, one slot per block.

`SlotMirror` applies kvplay's engine events — live ones (`Engine.subscribe_batches`) or recorded
rows (`sessions/history.py`), both as mappings through one `apply` — and answers what the cache
views ask: `summary(cells, start, stop, user)` (the block map's ranged summary, engine/observe.py
`BlockSummary`), `block(i)` (one `BlockView`), `arrays`, `counts()`, `stats()` and `copy()` (a
cheap checkpoint). No Textual, no SQLite, no network.

Per block, numbers live in numpy arrays (state, ref count, creator, hits, created, last used);
what only some blocks have (hash, tokens, request, users served) lives in dicts of the blocks
that have it. Nothing costs O(pool) per event; the arrays are touched only up to the highest
block id ever named (`hw`): the engine hands out never-used blocks in id order, so a session
that used a few hundred blocks of a 1,000,000-block pool costs a few hundred slots to copy.

Which blocks are in use: the engine's `BlocksAllocated` / `BlocksTouched` / `BlocksReleased`
events keep every block's ref count, so the state equals the engine pool's after any event.
Recordings made before those events existed hold no ref events: then a block is in use while a
request that stored or hit it is running (what a finished or preempted request held it
releases), which equals the pool between turns.

Events without block ids (a watched server's: vLLM's wire names blocks by hash only) get a slot
per (pod, hash): the lowest free one when stored, freed when removed or when the pod's cache is
cleared.
"""
from __future__ import annotations

import heapq

import msgspec
import numpy as np

from kvplay.engine.observe import BlockArrays, BlockSummary, BlockView, summarize

MAX_BLOCKS = 1 << 22  # the largest pool a mirror holds (~130 MB of arrays); larger ids are bad input
STATES = ("free", "cached", "in_use")
FREE, CACHED, IN_USE = 0, 1, 2
_REF_KINDS = ("BlocksAllocated", "BlocksTouched", "BlocksReleased")


class SlotMirror:
    """One pool, rebuilt from its events (see the module docstring)."""

    def __init__(self, num_blocks: int = 0, offset: int = 0):
        self.num_blocks = min(MAX_BLOCKS, max(0, int(num_blocks)))  # grows when an event names a block beyond it
        self.bad = 0  # events skipped as malformed (a recording or a wire is untrusted input)
        self.offset = offset  # where block 0 sits in a fleet's numbering (one map per pod)
        cap = max(16, min(self.num_blocks, 1024))  # grows by doubling as blocks are named
        self._alloc(cap)
        self.hw = 0  # 1 + the highest block id ever named
        self.hash: dict[int, str] = {}
        self.tokens: dict[int, tuple] = {}
        self.request: dict[int, str] = {}
        self.users_of: dict[int, set] = {}  # creator + users that hit it, for blocks holding something
        self.users: list[str] = []
        self._code: dict[str, int] = {}
        self.exact = False  # the events carry ref changes (BlocksAllocated/Touched/Released)
        self.held: dict[str, list[int]] = {}  # request -> blocks (recordings without ref events)
        self.prompt: dict[str, int] = {}
        self.started: set[str] = set()
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.hit: frozenset = frozenset()  # blocks the latest request reused
        self.last_blocks: tuple = ()  # blocks of the latest BlockStored / BlockHit
        self.hit_tokens = self.query_tokens = self.evictions = self.preemptions = 0
        self.requests_finished = self.collisions = 0
        self.extra_users = 0  # sum over blocks of max(0, len(users) - 1)
        self.applied = 0  # events applied
        self.version = 0  # bumps with every applied event or batch (views redraw when it moves)
        self.ts: float | None = None
        self.slot_of: dict[tuple, int] = {}  # (pod, hash) -> slot, for events without block ids
        self._free_slots: list[int] = []  # a heap of freed slots
        self._next_slot = 0

    def _alloc(self, cap: int) -> None:
        self.state = np.zeros(cap, np.int8)
        self.ref = np.zeros(cap, np.int32)
        self.creator = np.full(cap, -1, np.int32)
        self.hits = np.zeros(cap, np.int32)
        self.indexed = np.zeros(cap, np.int8)
        self.created_at = np.zeros(cap, np.float64)
        self.last_used = np.zeros(cap, np.float64)

    _ARRAYS = ("state", "ref", "creator", "hits", "indexed", "created_at", "last_used")

    def _grow(self, need: int) -> None:
        cap = len(self.state)
        new = max(need, cap * 2)
        for name in self._ARRAYS:
            old = getattr(self, name)
            arr = np.full(new, -1, old.dtype) if name == "creator" else np.zeros(new, old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)

    def _see(self, ids) -> None:
        """Check block ids `ids` (ints in [0, MAX_BLOCKS), else ValueError) and make room for them."""
        if not all(type(b) is int for b in ids):
            raise ValueError("block ids must be integers")
        if min(ids) < 0 or max(ids) >= MAX_BLOCKS:
            raise ValueError("block id out of range")
        top = max(ids) + 1
        if top > self.hw:
            if top > len(self.state):
                self._grow(top)
            self.hw = top
            if top > self.num_blocks:
                self.num_blocks = top

    def code(self, user: str | None) -> int:
        if not user:
            return -1
        c = self._code.get(user)
        if c is None:
            c = self._code[user] = len(self.users)
            self.users.append(user)
        return c

    # --- copies (checkpoints) ---------------------------------------------------------------------
    def copy(self) -> "SlotMirror":
        """An independent copy: arrays up to `hw`, dicts of the blocks that hold something."""
        m = SlotMirror.__new__(SlotMirror)
        m.__dict__.update(self.__dict__)
        cap = max(16, self.hw)
        for name in self._ARRAYS:
            setattr(m, name, getattr(self, name)[:cap].copy())
        m.hash, m.tokens, m.request = dict(self.hash), dict(self.tokens), dict(self.request)
        m.users_of = {b: set(u) for b, u in self.users_of.items()}
        m.users, m._code = list(self.users), dict(self._code)
        m.held = {r: list(b) for r, b in self.held.items()}
        m.prompt, m.started = dict(self.prompt), set(self.started)
        m.running, m.waiting = set(self.running), set(self.waiting)
        m.slot_of, m._free_slots = dict(self.slot_of), list(self._free_slots)
        return m

    # --- applying events --------------------------------------------------------------------------
    def apply_batch(self, batch) -> None:
        """An `EngineBatch` (engine/events.py): its events in order."""
        for ev in batch.events:
            self.apply(msgspec.structs.asdict(ev), type(ev).__name__)

    def apply_all(self, events) -> None:
        for e in events:
            self.apply(e)

    def _ids(self, e, store: bool = False) -> list[int]:
        """The blocks an event names: its block ids, else one slot per (pod, hash)."""
        ids = e.get("block_ids")
        if ids:
            if not isinstance(ids, list):
                raise TypeError("block_ids")
            return ids
        pod = e.get("pod")
        hashes = e.get("block_hashes") or ()
        if not isinstance(hashes, list) or not all(type(h) is str for h in hashes) or \
                (pod is not None and type(pod) is not str):
            raise TypeError("block_hashes")
        if store and self._next_slot + len(hashes) > MAX_BLOCKS:
            raise ValueError("too many blocks")
        out = []
        for h in hashes:
            key = (pod, h)
            slot = self.slot_of.get(key)
            if slot is None and store:
                if self._free_slots:
                    slot = heapq.heappop(self._free_slots)
                else:
                    slot, self._next_slot = self._next_slot, self._next_slot + 1
                self.slot_of[key] = slot
            if slot is not None:
                out.append(slot)
        return out

    def _drop_slots(self, pod, hashes=None) -> None:
        keys = [k for k in self.slot_of if k[0] == pod] if hashes is None else [(pod, h) for h in hashes]
        for k in keys:
            slot = self.slot_of.pop(k, None)
            if slot is not None:
                heapq.heappush(self._free_slots, slot)

    def _reset(self, b: int) -> None:
        """Forget what block `b` held (it is free now)."""
        self.hash.pop(b, None)
        self.tokens.pop(b, None)
        self.request.pop(b, None)
        users = self.users_of.pop(b, None)
        if users and len(users) > 1:
            self.extra_users -= len(users) - 1
        self.creator[b] = -1
        self.hits[b] = 0
        self.indexed[b] = 0
        self.state[b] = FREE

    def _add_user(self, b: int, user: str) -> None:
        users = self.users_of.get(b)
        if users is None:
            self.users_of[b] = {user}
        elif user not in users:
            users.add(user)
            self.extra_users += 1

    def _settle(self, b: int) -> None:
        """State from ref count and index, after a change to either."""
        if self.ref[b] > 0:
            self.state[b] = IN_USE
        elif self.indexed[b]:
            self.state[b] = CACHED
        else:
            self._reset(b)

    def _hold(self, rid: str, b: int) -> None:
        """Recordings without ref events: request `rid` holds block `b` (once)."""
        held = self.held.setdefault(rid, [])
        if b not in held:
            held.append(b)
            self.ref[b] += 1
            self.state[b] = IN_USE

    def _release(self, rid: str, ts: float) -> None:
        for b in self.held.pop(rid, ()):
            self.ref[b] -= 1
            self.last_used[b] = ts
            self._settle(b)

    def apply(self, e, kind: str | None = None) -> bool:
        """Apply one event: a mapping with the engine event's fields (a recorded row's payload,
        or `msgspec.structs.asdict(event)`), its kind given or under "kind". A malformed one (wrong types, block
        ids out of range) is counted in `bad` and skipped: False, never an exception. Checks
        come before changes, except that a BlockStored or BlockRemoved naming blocks by hash
        may have taken slots before a later field fails."""
        self.applied += 1  # every event counts, good or bad: History indexes events by it
        self.version += 1
        try:
            if kind is None:
                kind = e.get("kind")
            self._apply(e, kind)
            return True
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError):
            self.bad += 1
            return False

    def _apply(self, e, kind) -> None:
        ts = e.get("ts") or 0.0
        if not isinstance(ts, (int, float)):
            raise TypeError("ts")
        self.ts = ts or self.ts
        if kind in _REF_KINDS:
            self.exact = True
            ids = e.get("block_ids") or []
            if not isinstance(ids, list):
                raise TypeError("block_ids")
            if not ids:
                return
            self._see(ids)
            if kind == "BlocksAllocated":
                idx = np.asarray(ids, np.int64)
                if len(ids) > 64 and not (self.hash or self.users_of):  # bulk: fresh blocks of an empty pool
                    self.ref[idx] = 1
                    self.state[idx] = IN_USE
                    self.created_at[idx] = ts
                    self.last_used[idx] = ts
                    return
                for b in ids:
                    if self.state[b] != FREE or b in self.hash or b in self.users_of:
                        self._reset(b)
                    self.ref[b] = 1
                    self.state[b] = IN_USE
                    self.created_at[b] = self.last_used[b] = ts
            elif kind == "BlocksTouched":
                for b in ids:
                    self.ref[b] += 1
                    self.state[b] = IN_USE
                    self.last_used[b] = ts
            else:
                for b in ids:
                    if self.ref[b] > 0:
                        self.ref[b] -= 1
                    self.last_used[b] = ts
                    if self.ref[b] == 0:
                        self._settle(b)
            return
        rid = e.get("request_id") or ""
        if type(rid) is not str:
            raise TypeError("request_id")
        if kind == "BlockStored":
            hashes = e.get("block_hashes") or []
            tokens = e.get("token_ids") or []
            bs = e.get("block_size") or (len(tokens) // max(1, len(hashes)))
            user = e.get("user") or None
            if type(bs) is not int or bs < 0 or not isinstance(tokens, list) or not isinstance(hashes, list) \
                    or not all(type(h) is str for h in hashes) or (user is not None and type(user) is not str):
                raise TypeError("BlockStored")
            ids = self._ids(e, store=True)
            if not ids:
                return
            self._see(ids)
            code = self.code(user)
            for i, b in enumerate(ids):
                if not self.exact:
                    if self.ref[b] == 0:
                        self._reset(b)
                    self.created_at[b] = ts
                    self.last_used[b] = ts
                self.indexed[b] = 1
                if i < len(hashes):
                    self.hash[b] = hashes[i]
                else:
                    self.hash.pop(b, None)
                self.creator[b] = code
                self.request[b] = rid or None
                self.tokens[b] = tuple(tokens[i * bs:(i + 1) * bs])
                if user:
                    self._add_user(b, user)
                if rid and not self.exact:
                    self._hold(rid, b)
                elif self.ref[b] == 0:
                    self.state[b] = CACHED
            self.last_blocks = tuple(ids)
        elif kind == "BlockHit":
            if not isinstance(e.get("cached_tokens") or 0, int) or not isinstance(e.get("user") or "", str):
                raise TypeError("BlockHit")
            hit = self._ids(e)
            if hit:
                self._see(hit)
            self.hit = frozenset(hit)
            self.last_blocks = tuple(hit)
            self.hit_tokens += e.get("cached_tokens") or 0
            user = e.get("user")
            for b in hit:
                self.hits[b] += 1
                self.last_used[b] = ts
                if user:
                    self._add_user(b, user)
                if rid and not self.exact:
                    self._hold(rid, b)
        elif kind == "BlockRemoved":
            ids = self._ids(e)
            if ids:
                self._see(ids)
            if not e.get("block_ids"):
                self._drop_slots(e.get("pod"), e.get("block_hashes") or [])
            if e.get("reason", "evicted") == "evicted":
                self.evictions += len(ids)
            for b in ids:
                self.indexed[b] = 0
                if self.ref[b] == 0:
                    self._reset(b)
        elif kind == "AllBlocksCleared":
            self.hit = frozenset()
            pod = e.get("pod")
            slots = [v for k, v in self.slot_of.items() if k[0] == pod]
            if slots:  # a server's reset names no blocks: all of the pod's go
                for b in slots:
                    self.indexed[b] = 0
                    if self.ref[b] == 0:
                        self._reset(b)
                self._drop_slots(pod)
        elif kind == "RequestQueued":
            n = e.get("prompt_tokens") or 0
            if type(n) is not int:
                raise TypeError("prompt_tokens")
            self.prompt[rid] = n
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
            if not self.exact:
                self._release(rid, ts)
            self.running.discard(rid)
            self.waiting.add(rid)
        elif kind == "RequestFinished":
            if not self.exact:
                self._release(rid, ts)
            self.running.discard(rid)
            self.waiting.discard(rid)
            self.prompt.pop(rid, None)
            self.started.discard(rid)
            self.requests_finished += 1
        elif kind == "CollisionCaught":
            self.collisions += 1

    # --- what views ask -------------------------------------------------------------------------
    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use) blocks now: O(hw) numpy."""
        st = self.state[:self.hw]
        in_use = int(np.count_nonzero(st == IN_USE))
        cached = int(np.count_nonzero(st == CACHED))
        return self.num_blocks - cached - in_use, cached, in_use

    def count(self, state: str) -> int:
        return self.counts()[STATES.index(state)]

    def dedicated(self) -> int:
        """Blocks a cache without sharing would hold: resident blocks, one per user served."""
        free, cached, in_use = self.counts()
        return cached + in_use + self.extra_users

    def stats(self) -> dict:
        """The pool's counters, as `Engine.stats()` names them (those the events carry)."""
        free, cached, in_use = self.counts()
        return {"blocks_total": self.num_blocks, "blocks_free": free, "blocks_cached": cached,
                "blocks_in_use": in_use, "blocks_resident": cached + in_use,
                "blocks_dedicated": cached + in_use + self.extra_users,
                "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate,
                "evictions": self.evictions, "preemptions": self.preemptions,
                "collisions_caught": self.collisions, "requests_finished": self.requests_finished,
                "running": len(self.running), "waiting": len(self.waiting)}

    def arrays(self, start: int = 0, stop: int | None = None) -> BlockArrays:
        """Copies of the state and creator codes of blocks [start, stop)."""
        start, stop, _ = slice(start, stop).indices(self.num_blocks)
        n = max(0, stop - start)
        state = np.zeros(n, np.int8)
        creator = np.full(n, -1, np.int32)
        hi = min(stop, self.hw)
        if hi > start:
            state[:hi - start] = self.state[start:hi]
            creator[:hi - start] = self.creator[start:hi]
        return BlockArrays(self.version, start, state, creator, tuple(self.users))

    def used_arrays(self, start: int = 0, stop: int | None = None) -> tuple[BlockArrays, int]:
        """(copies of the codes of blocks [start, min(stop, hw)), the range's length): blocks
        past `hw` were never named, so free."""
        start, stop, _ = slice(start, stop).indices(self.num_blocks)
        hi = max(start, min(stop, self.hw))
        return (BlockArrays(self.version, start, self.state[start:hi].copy(), self.creator[start:hi].copy(),
                            tuple(self.users)), max(0, stop - start))

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None) -> BlockSummary:
        """Blocks [start, stop) in `cells` equal runs (engine/observe.summarize): costs the part
        of the range below `hw`."""
        arrays, total = self.used_arrays(start, stop)
        return summarize(arrays, cells, user, total=total)

    def block(self, b: int) -> BlockView | None:
        if not 0 <= b < self.num_blocks:
            return None
        if b >= self.hw:
            return BlockView(b, "free", 0, None, None, None, (), 0, 0.0, 0.0, ())
        c = int(self.creator[b])
        return BlockView(b, STATES[self.state[b]], int(self.ref[b]), self.hash.get(b),
                         self.users[c] if c >= 0 else None, self.request.get(b), self.tokens.get(b, ()),
                         int(self.hits[b]), float(self.created_at[b]), float(self.last_used[b]),
                         tuple(sorted(self.users_of.get(b, ()))))

    def views(self) -> tuple[BlockView, ...]:
        """Every block as a BlockView: O(pool), for tests and small pools."""
        return tuple(self.block(b) for b in range(self.num_blocks))

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

"""A prefix cache as its events describe it: the one `Mirror` every view reads (numpy slot
arrays, one slot per block), one per pod; a `Fleet` of them.

Sources, all through `apply`: the local engine's `EngineBatch` (`Engine.subscribe_batches`,
`apply_batch`), a recorded row (a mapping with the engine event's fields, `sessions/history.py`),
and a watched server's decoded wire `EventBatch` (vLLM, SGLang, kvplay serve: `apply_wire`).
What views ask: `summary(cells, start, stop, user)` (the block map's ranged summary,
engine/observe.py `BlockSummary`), `block(i)` (one `BlockView`), `arrays`, `counts()`, `stats()`,
`summary()` (the watch counters), `creators()`, `by_session` (who holds what), `blocks` (the
per-hash view the prefix tree and attribution read: hash -> slot, parent, tokens, creator,
holders, hits, age) and `copy()` (a cheap checkpoint). No Textual, no SQLite, no network.

Per block, numbers live in numpy arrays (state, ref count, creator, hits, created, last used);
what only some blocks have (hash key, parent, tokens, request, holders) lives in dicts of the
blocks that have it. Nothing costs O(pool) per event; the arrays are touched only up to the
highest block id ever named (`hw`): the engine hands out never-used blocks in id order, so a
session that used a few hundred blocks of a 1,000,000-block pool costs a few hundred slots to copy.

Which blocks are in use: the engine's `BlocksAllocated` / `BlocksTouched` / `BlocksReleased`
events keep every block's ref count, so the state equals the engine pool's after any event.
Recordings made before those events existed hold no ref events: then a block is in use while a
request that stored or hit it is running (what a finished or preempted request held it
releases), which equals the pool between turns.

Blocks by hash: a block's key is its hash as the source sends it (kvplay's engine: hex; vLLM:
a uint64 or a digest's bytes; SGLang: an int64), `(pod, hash)` for a recorded watched pod's,
`(group, hash)` for a hybrid model's group other than 0 (so no two alias). Events without block
ids (every server's wire) get a slot per key: the lowest free one when stored, freed when
removed or when the pod's cache is cleared.

**The one converter** between vLLM's form and kvplay's is `apply_wire`: a wire batch applied
in order, and, when `convert` is set (a watch recording, attach's views), the same changes as
kvplay engine events (a new block a `BlockStored` with `user` = who stored it, a re-announced
one — vLLM's kv_cache_report_mode "full" — a `BlockHit` of the reusing session with
`by_creator`, an eviction a `BlockRemoved` with its creators, a reset an `AllBlocksCleared`;
hashes as hex; `block_ids` the slots + `offset`).

Attribution of a stored wire block, in order: the event's `session_id` (vLLM copies it from
the request; SGLang sends it in metadata); else the session whose registered prompt
(`register_prompt`, called by kvplay's own panes for what they send) has the same token chain up
to this block; else `SOMEONE_ELSE` (another client of a shared server).

Watch counters (`summary()`): `blocks` cached now; `stored` block entries announced by
`BlockStored` (new and re-announced), `removed` blocks evicted, `cleared` cache resets;
`by_session` blocks each session holds now; `stored_by_session` blocks each session stored in
all; `gaps`, `replayed`, `restarts`, `lost` are counted by the subscriber that feeds the mirror.
Only the device tier is mirrored: wire events for another medium (vLLM's CPU offload tier "CPU",
"STORAGE") or with locality "REMOTE" are counted in `other_medium` and otherwise ignored.

Hostile input: an engine-form event with wrong types or block ids out of range is counted in
`bad` and skipped; wire events were typed at decode (wire/codec.py).
"""
from __future__ import annotations

import heapq
import threading
from collections import Counter
from collections.abc import Mapping
from operator import itemgetter
from typing import NamedTuple

import msgspec
import numpy as np

from kvplay.engine import events as ev_
from kvplay.engine.observe import BlockArrays, BlockSummary, BlockView, summarize

from .codec import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, hash_hex

MAX_BLOCKS = 1 << 22  # the largest pool a mirror holds (~130 MB of arrays); larger ids are bad input
STATES = ("free", "cached", "in_use")
FREE, CACHED, IN_USE = 0, 1, 2
_REF_KINDS = ("BlocksAllocated", "BlocksTouched", "BlocksReleased")
SOMEONE_ELSE = "someone else"


def _let_go(by_session: Counter, holders) -> None:
    """A block's holders no longer hold it (a count at 0 leaves the counter)."""
    for u in holders:
        c = by_session[u] - 1
        if c > 0:
            by_session[u] = c
        else:
            del by_session[u]


class Applied(NamedTuple):
    """What one wire batch did: block entries stored, removed, caches cleared; and the engine
    events saying so (empty unless the mirror's `convert` is set)."""
    stored: int
    removed: int
    cleared: int
    events: list


class Block(tuple):
    """One cached block as the per-hash view shows it (made on demand from the slot arrays; a
    tuple, so making a million for the prefix tree is cheap)."""
    __slots__ = ()
    key = property(itemgetter(0))
    hash = property(itemgetter(1))
    slot = property(itemgetter(2))
    parent = property(itemgetter(3))   # the parent's hash as the source sent it (None: a root)
    _tok = property(itemgetter(4))
    creator = property(itemgetter(5))
    holders = property(itemgetter(6))  # the creator, then who reused it, in order
    hits = property(itemgetter(7))
    ts = property(itemgetter(8))       # when it was stored
    last_used = property(itemgetter(9))

    def __new__(cls, m: "Mirror", key, slot: int):
        c = int(m.creator[slot])
        return tuple.__new__(cls, (key, key[1] if type(key) is tuple else key, slot, m.parent.get(slot),
                                   m.tokens.get(slot, ()), m.users[c] if c >= 0 else None,
                                   tuple(m.users_of.get(slot, ())), int(m.hits[slot]),
                                   float(m.created_at[slot]), float(m.last_used[slot])))

    @property
    def tokens(self) -> list[int]:
        return list(self[4])

    @property
    def size(self) -> int:
        return len(self[4])

    @property
    def hex(self) -> str:
        return hash_hex(self[1])

    def __repr__(self) -> str:
        return f"Block({self.hex}, slot={self.slot}, creator={self.creator!r}, holders={self.holders!r})"


class BlocksByKey(Mapping):
    """A mirror's cached blocks by key (see the module docstring): what the prefix tree reads."""

    def __init__(self, m: "Mirror"):
        self._m = m

    def __getitem__(self, key) -> Block:
        return Block(self._m, key, self._m.key_slot[key])

    def get(self, key, default=None):
        s = self._m.key_slot.get(key)
        return default if s is None else Block(self._m, key, s)

    def __contains__(self, key) -> bool:
        return key in self._m.key_slot

    def __iter__(self):
        return iter(self._m.key_slot)

    def __len__(self) -> int:
        return len(self._m.key_slot)

    def items(self):
        return self.as_dict().items()

    def values(self):
        return self.as_dict().values()

    def as_dict(self) -> dict:
        """Every cached block as a dict key -> Block, the arrays read once."""
        m = self._m
        hw = m.hw
        creator, hits = m.creator[:hw].tolist(), m.hits[:hw].tolist()
        created, last = m.created_at[:hw].tolist(), m.last_used[:hw].tolist()
        users, parent, tokens, users_of = m.users, m.parent, m.tokens, m.users_of
        mk = tuple.__new__
        out = {}
        for k, s in m.key_slot.items():
            c = creator[s]
            out[k] = mk(Block, (k, k[1] if type(k) is tuple else k, s, parent.get(s), tokens.get(s, ()),
                                users[c] if c >= 0 else None, tuple(users_of.get(s, ())), hits[s], created[s],
                                last[s]))
        return out

    def columns(self) -> tuple:
        """What the prefix tree reads, with no object per block: (key -> slot, slot -> parent
        hash, slot -> tokens, slot -> creator, slot -> holders, slot -> time stored)."""
        m = self._m
        users = m.users
        names = [users[c] if c >= 0 else None for c in m.creator[:m.hw].tolist()]
        return m.key_slot, m.parent, m.tokens, names, m.users_of, m.created_at[:m.hw].tolist()


class Mirror:
    """One pool (one pod's cache), rebuilt from its events (see the module docstring)."""

    def __init__(self, num_blocks: int = 0, offset: int = 0, pod: str = "pod0", prompts: "PromptIndex | None" = None):
        self.num_blocks = min(MAX_BLOCKS, max(0, int(num_blocks)))  # grows when an event names a block beyond it
        self.bad = 0  # events skipped as malformed (a recording or a wire is untrusted input)
        self.offset = offset  # where block 0 sits in a fleet's numbering (one map per pod)
        self.pod = pod
        self.prompts = prompts if prompts is not None else PromptIndex()
        cap = max(16, min(self.num_blocks, 1024))  # grows by doubling as blocks are named
        self._alloc(cap)
        self.hw = 0  # 1 + the highest block id ever named
        self.key_slot: dict = {}   # block key (module docstring) -> slot
        self.key: dict = {}        # slot -> block key
        self.parent: dict = {}     # slot -> its parent's hash (as the source sent it)
        self.tokens: dict[int, tuple] = {}
        self.request: dict[int, str] = {}
        self.users_of: dict[int, tuple] = {}  # slot -> (creator, then users that reused it), in order; replaced, never changed in place (a shallow copy is a snapshot)
        self._chain: dict[int, int] = {}  # slot -> token-chain id (attribution by registered prompts)
        self.by_session: Counter = Counter()  # blocks each user holds now
        self.stored_by_session: Counter = Counter()  # wire: blocks each session stored, in all
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
        self.applied = 0  # engine-form events applied
        self.version = 0  # bumps with every applied event or batch (views redraw when it moves)
        self.ts: float | None = None
        self._free_slots: list[int] = []  # a heap of freed slots (blocks named by hash only)
        self._next_slot = 0
        # wire counters (see the module docstring)
        self.convert = False  # apply_wire also returns engine events
        self.stored = self.new_blocks = self.reannounced = self.removed = self.removed_unknown = 0
        self.cleared = self.other_medium = self.gaps = self.replayed = self.restarts = self.lost = 0
        self.batches = self.events = 0
        self.last_seq = -1
        self.last_ts = 0.0
        self.pod_state = "waiting"  # the subscriber's word for the pod: waiting, live, replaying, stale

    def _alloc(self, cap: int) -> None:
        self.state = np.zeros(cap, np.int8)
        self.ref = np.zeros(cap, np.int32)
        self.creator = np.full(cap, -1, np.int32)
        self.hits = np.zeros(cap, np.int32)
        self.indexed = np.zeros(cap, np.int8)
        self.created_at = np.zeros(cap, np.float64)
        self.last_used = np.zeros(cap, np.float64)
        self._mvs = None

    _ARRAYS = ("state", "ref", "creator", "hits", "indexed", "created_at", "last_used")
    _DICTS = ("key_slot", "key", "parent", "tokens", "request", "_chain", "_code", "prompt")

    def _grow(self, need: int) -> None:
        cap = len(self.state)
        new = max(need, cap * 2)
        for name in self._ARRAYS:
            old = getattr(self, name)
            arr = np.full(new, -1, old.dtype) if name == "creator" else np.zeros(new, old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)
        self._mvs = None

    def _see(self, ids) -> None:
        """Check block ids `ids` (ints in [0, MAX_BLOCKS), else ValueError) and make room for them."""
        if not all(type(b) is int for b in ids):
            raise ValueError("block ids must be integers")
        if min(ids) < 0 or max(ids) >= MAX_BLOCKS:
            raise ValueError("block id out of range")
        self._room(max(ids) + 1)

    def _room(self, top: int) -> None:
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

    @property
    def blocks(self) -> BlocksByKey:
        return BlocksByKey(self)

    # --- copies (checkpoints) ---------------------------------------------------------------------
    def copy(self) -> "Mirror":
        """An independent copy: arrays up to `hw`, dicts of the blocks that hold something (the
        prompt index is shared: it only grows)."""
        m = Mirror.__new__(Mirror)
        m.__dict__.update(self.__dict__)
        cap = max(16, self.hw)
        for name in self._ARRAYS:
            setattr(m, name, getattr(self, name)[:cap].copy())
        for name in self._DICTS:
            setattr(m, name, dict(getattr(self, name)))
        m.users_of = dict(self.users_of)
        m.by_session, m.stored_by_session = Counter(self.by_session), Counter(self.stored_by_session)
        m.users = list(self.users)
        m.held = {r: list(b) for r, b in self.held.items()}
        m.started, m.running, m.waiting = set(self.started), set(self.running), set(self.waiting)
        m._free_slots = list(self._free_slots)
        m._mvs = None
        return m

    # --- what every source shares -----------------------------------------------------------------
    def _slot_for(self, key) -> int:
        """A slot for a block named by key only: its own, else the lowest free one."""
        s = self.key_slot.get(key)
        if s is None:
            if self._free_slots:
                s = heapq.heappop(self._free_slots)
            elif self._next_slot >= MAX_BLOCKS:
                raise ValueError("too many blocks")
            else:
                s = self._next_free()
            self.key_slot[key] = s
        return s

    def _next_free(self) -> int:
        """The lowest never-used slot (the caller checked it is below MAX_BLOCKS), with room in
        the arrays (which may be new ones)."""
        s = self._next_slot
        self._next_slot = s + 1
        if s >= self.hw:
            self._room(s + 1)
        return s

    def _free_slot(self, key) -> int | None:
        """Forget the slot of a block named by key only (it goes back to the free heap)."""
        s = self.key_slot.pop(key, None)
        if s is not None:
            heapq.heappush(self._free_slots, s)
            if self.key.get(s) == key:
                del self.key[s]
        return s

    def _name(self, b: int, key) -> None:
        """Block `b` holds `key` now (a block id's former key lets go of it)."""
        old = self.key.get(b)
        if old is not None and old != key and self.key_slot.get(old) == b:
            del self.key_slot[old]
        self.key[b] = key
        self.key_slot[key] = b
        self._chain.pop(b, None)

    def _reset(self, b: int) -> None:
        """Forget what block `b` held (it is free now)."""
        key = self.key.pop(b, None)
        if key is not None and self.key_slot.get(key) == b:
            del self.key_slot[key]
        self.parent.pop(b, None)
        self.tokens.pop(b, None)
        self.request.pop(b, None)
        self._chain.pop(b, None)
        users = self.users_of.pop(b, None)
        if users:
            self.extra_users -= len(users) - 1
            _let_go(self.by_session, users)
        self.creator[b] = -1
        self.hits[b] = 0
        self.indexed[b] = 0
        self.state[b] = FREE

    def _add_user(self, b: int, user: str) -> bool:
        users = self.users_of.get(b)
        if users is None:
            self.users_of[b] = (user,)
        elif user in users:
            return False
        else:
            self.users_of[b] = users + (user,)
            self.extra_users += 1
        self.by_session[user] += 1
        return True

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

    def _clear_keys(self, pod=None, everything: bool = False) -> None:
        """A cache reset that names no blocks: every block named by key (of `pod`) goes."""
        keys = list(self.key_slot) if everything else \
            [k for k in self.key_slot if (k[0] if type(k) is tuple else None) == pod]
        for k in keys:
            s = self._free_slot(k)
            if s is None:
                continue
            self.indexed[s] = 0
            if self.ref[s] == 0:
                self._reset(s)

    # --- one entry point ----------------------------------------------------------------------------
    def apply(self, item, arg=None):
        """Apply what a source gives: a wire `EventBatch` (`apply_wire`; `arg` its seq), an
        engine `EngineBatch` (`apply_batch`), one engine event, or one engine-form event as a
        mapping (a recorded row: `arg` its kind, else its "kind" key)."""
        if type(item) is EventBatch:
            return self.apply_wire(item, -1 if arg is None else arg)
        if isinstance(item, ev_.Event):
            return self.apply_event(msgspec.structs.asdict(item), type(item).__name__)
        if hasattr(item, "events") and hasattr(item, "step"):
            return self.apply_batch(item)
        return self.apply_event(item, arg)

    def apply_batch(self, batch) -> None:
        """An `EngineBatch` (engine/events.py): its events in order."""
        for ev in batch.events:
            self.apply_event(msgspec.structs.asdict(ev), type(ev).__name__)

    def apply_all(self, events) -> None:
        for e in events:
            self.apply_event(e)

    # --- kvplay's engine events (live, or recorded rows) --------------------------------------------
    def apply_event(self, e, kind: str | None = None) -> bool:
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

    @staticmethod
    def _keys(e, hashes) -> list:
        pod = e.get("pod")
        if pod is not None and type(pod) is not str:
            raise TypeError("pod")
        return list(hashes) if pod is None else [(pod, h) for h in hashes]

    def _ids(self, e, store: bool = False) -> list[int]:
        """The blocks an event names: its block ids, else one slot per key."""
        ids = e.get("block_ids")
        if ids:
            if not isinstance(ids, list):
                raise TypeError("block_ids")
            return ids
        hashes = e.get("block_hashes") or ()
        if not isinstance(hashes, list) or not all(type(h) is str for h in hashes):
            raise TypeError("block_hashes")
        keys = self._keys(e, hashes)
        if store:
            return [self._slot_for(k) for k in keys]
        return [s for s in map(self.key_slot.get, keys) if s is not None]

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
                if len(ids) > 64 and not (self.key or self.users_of):  # bulk: fresh blocks of an empty pool
                    self.ref[idx] = 1
                    self.state[idx] = IN_USE
                    self.created_at[idx] = ts
                    self.last_used[idx] = ts
                    return
                for b in ids:
                    if self.state[b] != FREE or b in self.key or b in self.users_of:
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
            parent = e.get("parent_block_hash")
            if type(bs) is not int or bs < 0 or not isinstance(tokens, list) or not isinstance(hashes, list) \
                    or not all(type(t) is int for t in tokens) \
                    or not all(type(h) is str for h in hashes) or (user is not None and type(user) is not str) \
                    or (parent is not None and type(parent) is not str):
                raise TypeError("BlockStored")
            ids = self._ids(e, store=True)
            if not ids:
                return
            self._see(ids)
            keys = self._keys(e, hashes)
            code = self.code(user)
            for i, b in enumerate(ids):
                if not self.exact:
                    if self.ref[b] == 0:
                        self._reset(b)
                    self.created_at[b] = ts
                    self.last_used[b] = ts
                self.indexed[b] = 1
                if i < len(keys):
                    self._name(b, keys[i])
                    p = parent if i == 0 else hashes[i - 1]
                    if p is None:
                        self.parent.pop(b, None)
                    else:
                        self.parent[b] = p
                else:
                    old = self.key.pop(b, None)
                    if old is not None and self.key_slot.get(old) == b:
                        del self.key_slot[old]
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
                for k in self._keys(e, e.get("block_hashes") or []):
                    self._free_slot(k)
            if e.get("reason", "evicted") == "evicted":
                self.evictions += len(ids)
            for b in ids:
                self.indexed[b] = 0
                if self.ref[b] == 0:
                    self._reset(b)
        elif kind == "AllBlocksCleared":
            self.hit = frozenset()
            pod = e.get("pod")
            if pod is not None or self._next_slot:  # a server's reset names no blocks: all of the pod's go
                self._clear_keys(pod)
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

    # --- a server's wire batches: the one converter ---------------------------------------------------
    def apply_wire(self, batch: EventBatch, seq: int = -1) -> Applied:
        """Apply one decoded wire batch in order (see the module docstring)."""
        out = [] if self.convert else None
        stored, removed, cleared = self._wire_events(batch.events, batch.ts, out)
        self.batches += 1
        self.events += len(batch.events)
        if seq >= 0:
            self.last_seq = seq
        ts = batch.ts
        self.last_ts = ts
        self.ts = ts or self.ts
        self.version += 1
        return Applied(stored, removed, cleared, out or [])

    def _views(self) -> tuple:
        """Memoryviews of the arrays the wire path writes (an item write costs less than numpy's)."""
        v = self._mvs
        if v is None:
            v = self._mvs = tuple(memoryview(getattr(self, n)) for n in
                                  ("state", "creator", "indexed", "created_at", "last_used", "hits"))
        return v

    def _wire_events(self, events, ts: float, out) -> tuple[int, int, int]:
        """A wire batch's events, in one loop with what it touches held in locals (a busy server
        sends dozens of small events a batch: per-call set-up would cost more than the blocks).
        Per block only what the block map needs is written; a session's counters are added once
        per event (the blocks it holds even when a later block of the event fails). Returns
        (block entries stored, blocks removed, caches cleared)."""
        key_slot, keys, parents, tokens, chains = self.key_slot, self.key, self.parent, self.tokens, self._chain
        stored_by, by_session, users_of, codes = self.stored_by_session, self.by_session, self.users_of, self._code
        users = self.users
        free = self._free_slots
        heappop, heappush = heapq.heappop, heapq.heappush
        st, cr, ix, ca, lu, hi = self._views()
        offset = self.offset
        Stored, Hit, Removed = ev_.BlockStored, ev_.BlockHit, ev_.BlockRemoved
        last = None  # the engine event the next change may extend (convert)
        total = new = extra = n_removed = unknown = cleared = 0
        try:
            for ev in events:
                cls = type(ev)
                if cls is AllBlocksCleared:
                    self.clear()
                    if out is not None:
                        out.append(ev_.AllBlocksCleared(ts=ts, reason="cleared"))
                        last = None
                    cleared += 1
                    continue
                if cls is not BlockStored and cls is not BlockRemoved:
                    continue  # no wire event: nothing to apply
                medium = ev.medium
                hashes = ev.block_hashes
                if (medium is not None and medium != MEDIUM_GPU) or ev.locality == "REMOTE":
                    self.other_medium += len(hashes)  # another tier: not mirrored
                    continue
                g = ev.group_idx
                if cls is BlockRemoved:
                    for h in hashes:
                        s = key_slot.pop((g, h) if g else h, None)
                        if s is None:
                            unknown += 1
                            continue
                        if out is not None:
                            if type(last) is not Removed:
                                last = Removed(ts=ts, block_hashes=[], block_ids=[], creators=[])
                                out.append(last)
                            c = cr[s]
                            last.block_hashes.append(hash_hex(h))
                            last.block_ids.append(s + offset)
                            last.creators.append(users[c] if c >= 0 else "")
                        del keys[s]
                        heappush(free, s)
                        parents.pop(s, None)
                        del tokens[s]
                        if chains:
                            chains.pop(s, None)
                        held = users_of.pop(s)
                        extra -= len(held) - 1
                        _let_go(by_session, held)
                        cr[s] = -1
                        hi[s] = st[s] = 0
                        n_removed += 1
                    continue
                # BlockStored
                n = len(hashes)
                if not n:
                    continue
                room = len(free) + MAX_BLOCKS - self._next_slot
                if n > room and sum(((g, h) if g else h) not in key_slot for h in hashes) > room:
                    raise ValueError("too many blocks")  # before any change: an event is applied whole or not at all
                sid = ev.session_id
                parent = ev.parent_block_hash
                size = ev.block_size
                tok = None  # its tokens as a tuple, made for its first new block (tuples: the GC stops tracking them)
                total += n  # announced
                off = 0
                sid_new = 0  # blocks of this event `sid` stored
                code = codes.get(sid)  # None: named when it first stores a block
                only = (sid,)  # its holders when `sid` stored it (one tuple for the event's blocks)
                prev = hash_hex(parent) if out is not None else None  # the hex of the block before this one
                if sid is not None:
                    stored_by[sid] += n
                try:
                    for h in hashes:
                        key = (g, h) if g else h
                        s = key_slot.get(key)
                        if s is None:
                            if tok is None:
                                tok = tuple(ev.token_ids)
                            if sid is None:
                                who = self._attribute(parent, tok, off, size, g)
                                c = codes.get(who)
                                cr_code = self.code(who) if c is None else c
                            else:
                                if code is None:
                                    code = self.code(sid)
                                who, cr_code = sid, code
                            if free:
                                s = heappop(free)
                            else:
                                s = self._next_free()
                                if s >= len(st):
                                    st, cr, ix, ca, lu, hi = self._views()
                            key_slot[key] = s
                            keys[s] = key
                            if parent is not None:
                                parents[s] = parent
                            toks = tokens[s] = tok[off:off + size]
                            cr[s] = cr_code
                            st[s] = CACHED  # `indexed` is the engine's ref-count bookkeeping: a server's block is just cached
                            ca[s] = lu[s] = ts
                            users_of[s] = only if who is sid else (who,)
                            new += 1
                            if sid is None:
                                by_session[who] += 1
                            else:
                                sid_new += 1
                            if out is not None:
                                hx = hash_hex(h)
                                if type(last) is Stored and last.user == who and last.block_size == size \
                                        and last.block_hashes[-1] == prev:  # the chain goes on: one event, like vLLM's
                                    last.block_hashes.append(hx)
                                    last.block_ids.append(s + offset)
                                    last.token_ids.extend(toks)
                                else:
                                    last = Stored(ts=ts, block_hashes=[hx], parent_block_hash=prev,
                                                  token_ids=list(toks), block_size=size, block_ids=[s + offset],
                                                  user=who)
                                    out.append(last)
                                prev = hx
                        else:
                            c = cr[s]
                            creator = users[c] if c >= 0 else ""  # "": stored with an empty session id
                            who = creator if sid is None else sid
                            held = users_of[s]
                            if who not in held:
                                users_of[s] = held + (who,)
                                extra += 1
                                by_session[who] += 1
                            hi[s] += 1
                            lu[s] = ts
                            if out is not None:
                                if type(last) is not Hit or last.user != who:
                                    last = Hit(ts=ts, user=who, block_hashes=[], block_ids=[], cached_tokens=0,
                                               by_creator={})
                                    out.append(last)
                                prev = hash_hex(h)
                                last.block_hashes.append(prev)
                                last.block_ids.append(s + offset)
                                last.cached_tokens += size
                                last.by_creator[creator] = last.by_creator.get(creator, 0) + size
                        if sid is None:
                            stored_by[who] += 1
                        parent = h
                        off += size
                finally:
                    if sid_new:
                        by_session[sid] += sid_new
        finally:
            self.extra_users += extra
            self.new_blocks += new
            self.reannounced += total - new
            self.stored += total
            self.removed_unknown += unknown
            self.evictions += n_removed
            self.removed += n_removed
        return total, n_removed, cleared

    def clear(self) -> None:
        """AllBlocksCleared from a server (or a publisher restart): its cache is empty."""
        self._clear_keys(everything=True)
        self.hit = frozenset()
        self.cleared += 1
        self.version += 1

    def reset_for_restart(self) -> None:
        """The publisher restarted (its seq went backwards): its cache is gone with it."""
        self._clear_keys(everything=True)
        self.hit = frozenset()
        self.restarts += 1
        self.last_seq = -1
        self.version += 1

    # --- attribution by token chain ----------------------------------------------------------
    def _chain_of(self, key, group_idx) -> int | None:
        """The token-chain id of a cached block (None when its chain leaves the mirror). Walks
        up iteratively: prompts can be thousands of blocks deep."""
        path = []
        s = self.key_slot.get(key)
        chains = self._chain
        while s is not None and s not in chains:
            path.append(s)
            p = self.parent.get(s)
            if p is None:
                s = None
                chain = None
                break
            s = self.key_slot.get((group_idx, p) if group_idx else p)
        else:
            if s is None:
                return None
            chain = chains[s]
        for slot in reversed(path):
            chain = chains[slot] = hash((chain, tuple(self.tokens.get(slot, ()))))
        return chain

    def _attribute(self, parent, tok, off, size, group_idx) -> str:
        if not self.prompts or not size:
            return SOMEONE_ELSE
        if parent is None:
            parent_chain = None
        else:
            parent_chain = self._chain_of((group_idx, parent) if group_idx else parent, group_idx)
            if parent_chain is None:
                return SOMEONE_ELSE
        chain = hash((parent_chain, tuple(tok[off:off + size])))
        return self.prompts.lookup(chain, size) or SOMEONE_ELSE

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

    def summary(self, cells: int | None = None, start: int = 0, stop: int | None = None,
                user: str | None = None):
        """With `cells`: blocks [start, stop) in `cells` equal runs (engine/observe.summarize; the
        block map's `BlockSummary`), costing the part of the range below `hw`. Without: the
        watch counters (module docstring) as a dict."""
        if cells is None:
            return {"blocks": len(self.key_slot), "by_session": dict(sorted(self.by_session.items())),
                    "stored_by_session": dict(sorted(self.stored_by_session.items())),
                    "stored": self.stored, "removed": self.removed, "gaps": self.gaps,
                    "replayed": self.replayed, "restarts": self.restarts}
        arrays, total = self.used_arrays(start, stop)
        return summarize(arrays, cells, user, total=total)

    def creators(self) -> Counter:
        """Blocks cached now by who stored them (sums to `len(blocks)`)."""
        codes = Counter(int(self.creator[s]) for s in self.key_slot.values())
        return Counter({(self.users[c] if c >= 0 else None): n for c, n in codes.items()})

    def block(self, b: int) -> BlockView | None:
        if not 0 <= b < self.num_blocks:
            return None
        if b >= self.hw:
            return BlockView(b, "free", 0, None, None, None, (), 0, 0.0, 0.0, ())
        c = int(self.creator[b])
        key = self.key.get(b)
        return BlockView(b, STATES[self.state[b]], int(self.ref[b]),
                         None if key is None else hash_hex(key[1] if type(key) is tuple else key),
                         self.users[c] if c >= 0 else None, self.request.get(b), tuple(self.tokens.get(b, ())),
                         int(self.hits[b]), float(self.created_at[b]), float(self.last_used[b]),
                         tuple(sorted(self.users_of.get(b, ()))))

    def views(self) -> tuple[BlockView, ...]:
        """Every block as a BlockView: O(pool), for tests and small pools."""
        return tuple(self.block(b) for b in range(self.num_blocks))

    @staticmethod
    def pod_of(key):
        """The pod a block key names (a recording of watched pods keys blocks (pod, hash)), or None."""
        return key[0] if type(key) is tuple and type(key[0]) is str else None

    def pods_blocks(self) -> dict:
        """The cached blocks by pod (`pod_of` their keys): {None: blocks} unless a recording of
        watched pods keys them by pod."""
        out: dict = {}
        for key in self.key_slot:
            if type(key) is tuple and type(key[0]) is str:
                out.setdefault(key[0], {})
        if not out:
            return {None: self.blocks} if self.key_slot else {}
        for key, s in self.key_slot.items():
            out.setdefault(self.pod_of(key), {})[key] = Block(self, key, s)
        return out

    def block_hits(self) -> dict:
        """Hits per key of the cached blocks that have any (the local engine counts them)."""
        hits = self.hits
        return {k: int(hits[s]) for k, s in self.key_slot.items() if hits[s]}

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PromptIndex:
    """Prompts kvplay's own panes sent, indexed by token chain per block size, so blocks stored
    without a session_id can still be attributed to the pane that caused them."""

    def __init__(self):
        self._prompts: list[tuple[str, tuple[int, ...]]] = []
        self._by_size: dict[int, dict[int, str]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def register(self, session: str, token_ids) -> None:
        toks = tuple(token_ids)
        self._prompts.append((session, toks))
        for size, index in self._by_size.items():
            self._index(index, session, toks, size)

    @staticmethod
    def _index(index: dict, session: str, toks: tuple, size: int) -> None:
        chain = None
        for start in range(0, len(toks) - size + 1, size):
            chain = hash((chain, toks[start:start + size]))
            index.setdefault(chain, session)  # the first pane that sent a prefix stored it

    def lookup(self, chain: int, size: int) -> str | None:
        index = self._by_size.get(size)
        if index is None:
            index = self._by_size[size] = {}
            for session, toks in self._prompts:
                self._index(index, session, toks, size)
        return index.get(chain)


class Fleet:
    """Mirrors by pod name, sharing one prompt index (a pane's prompt may land on any pod)."""

    def __init__(self):
        self.prompts = PromptIndex()
        self.pods: dict[str, Mirror] = {}
        self.lock = threading.RLock()  # held while a batch is applied; views take it to read

    def pod(self, name: str, num_blocks: int = 0, offset: int = 0) -> Mirror:
        m = self.pods.get(name)
        if m is None:
            m = self.pods[name] = Mirror(num_blocks, offset, name, self.prompts)
        return m

    def register_prompt(self, session: str, token_ids) -> None:
        with self.lock:
            self.prompts.register(session, token_ids)

    def totals(self) -> dict:
        tot = {"blocks": 0, "stored": 0, "removed": 0, "gaps": 0, "replayed": 0, "restarts": 0}
        by_session: Counter = Counter()
        for m in self.pods.values():
            s = m.summary()
            for k in tot:
                tot[k] += s[k]
            by_session.update(m.by_session)
        tot["by_session"] = dict(sorted(by_session.items()))
        return tot

    def summary(self) -> dict:
        return {"summary": True, "pods": {name: m.summary() for name, m in self.pods.items()}}

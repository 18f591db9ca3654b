"""A prefix cache as its events describe it: the one `Mirror` every view reads (numpy slot
arrays, one slot per block), one per pod; a `Fleet` of them.

One source of truth, one entry point: `apply(batch)` takes an `EngineBatch` of engine events
(engine/events.py) and matches on their types — the one state machine of the pool. Every source
gives it that: the local engine (`Engine.subscribe_batches`), a recording (sessions/event_log.py
reads rows back as batches), and a watched server, whose decoded wire batches a `FromWire`
(wire/translate.py) turns into engine batches first (slots for blocks named by hash, attribution).
What views ask: `summary(cells, start, stop, user)` (the block map's ranged summary,
wire/views.py `BlockSummary`), `block(i)` (one `BlockView`), `arrays`, `counts()`, `stats()`,
`summary()` (the watch counters), `creators()`, `by_session` (who holds what), `blocks` (the
per-hash view the prefix tree and attribution read: hash -> slot, parent, tokens, creator,
holders, hits, age) and `copy()` (a cheap checkpoint). No Textual, no SQLite, no network.

Per block, numbers live in numpy arrays (state, ref count, creator, hits, created, last used);
a block's key, parent, tokens and holders in lists by slot (`SlotMap`: a mapping to the views,
one list item to the apply loop, where a dict of 100,000 blocks costs cache misses on every
write), the requests of a recording's blocks in a dict. Nothing costs O(pool) per event; the
arrays and lists are copied only up to the highest block id ever named (`hw`): the engine hands
out never-used blocks in id order, so a session that used a few hundred blocks of a
1,000,000-block pool costs a few hundred slots to copy.

Which blocks are in use: the engine's `BlocksAllocated` / `BlocksTouched` / `BlocksReleased`
events keep every block's ref count, so the state equals the engine pool's after any event.
Recordings made before those events existed hold no ref events (nor do servers send any): then a
block is in use while a request that stored or hit it is running (what a finished or preempted
request held it releases), which equals the pool between turns; a server's blocks are cached.

Blocks by hash: a block's key is its hash as the source sent it (kvplay's engine: hex; vLLM: a
uint64; SGLang: an int64), `(pod, hash)` in a batch from a pod of a recording of watched pods (its
`pod` envelope), `(group, hash)` for a hybrid model's group other than 0 (so no two alias). Block
ids are the pod's place in a fleet's numbering (`offset` + slot).

Watch counters (`summary()`, kept by the pod's `FromWire` and subscriber): `blocks` cached now;
`stored` block entries announced by `BlockStored` (new and re-announced), `removed` blocks
evicted, `cleared` cache resets; `by_session` blocks each session holds now; `stored_by_session`
blocks each session stored in all; `gaps`, `replayed`, `restarts`, `lost` are counted by the
subscriber that feeds the mirror.

Events were typed and bounded where they entered (decoding a recorded row or a wire payload):
`apply` checks nothing again.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, MutableMapping
from itertools import chain, compress, repeat
from operator import is_not, itemgetter

import numpy as np

from kvplay.engine import events as ev_

from .codec import hash_hex
from .translate import FromWire, PromptIndex
from .views import STATES, BlockArrays, BlockSummary, BlockView, summarize

MAX_BLOCKS = ev_.MAX_BLOCKS  # the largest pool a mirror holds (~130 MB of arrays, ~130 MB of slot lists)
FREE, CACHED, IN_USE = 0, 1, 2


def _let_go(by_session: Counter, holders) -> None:
    """A block's holders no longer hold it (a count at 0 leaves the counter)."""
    for u in holders:
        c = by_session[u] - 1
        if c > 0:
            by_session[u] = c
        else:
            del by_session[u]


class SlotMap(MutableMapping):
    """slot -> value, kept in a list indexed by slot (None: no value) as long as the mirror's
    arrays: what the mirror keeps for some blocks (key, parent, tokens, holders). Its apply loop
    reads and writes the list (`v`) itself: a slot's entry is one list item, where a dict of
    100,000 blocks costs two cache misses and a resize now and then. Read as a mapping (the
    views), it is a dict of the slots that hold a value; iterating costs O(slots)."""
    __slots__ = ("v",)

    def __init__(self, values: list | None = None):
        self.v = [] if values is None else values

    def get(self, s, default=None):
        try:
            x = self.v[s]
        except (IndexError, TypeError):  # no slot (or no int)
            return default
        return default if x is None or s < 0 else x

    def __getitem__(self, s):
        x = self.get(s)
        if x is None:
            raise KeyError(s)
        return x

    def __contains__(self, s) -> bool:
        return self.get(s) is not None

    def __setitem__(self, s: int, x) -> None:
        if x is None:
            raise ValueError("a slot map holds no None")
        v = self.v
        if not 0 <= s < len(v):
            if s < 0:
                raise KeyError(s)
            v.extend([None] * (s + 1 - len(v)))
        v[s] = x

    def __delitem__(self, s) -> None:
        self[s]  # KeyError when it holds nothing
        self.v[s] = None

    def __iter__(self):
        v = self.v
        return compress(range(len(v)), map(is_not, v, repeat(None)))

    def __len__(self) -> int:
        return len(self.v) - self.v.count(None)

    def __bool__(self) -> bool:
        return any(map(is_not, self.v, repeat(None)))

    def items(self) -> list:
        v = self.v
        return list(compress(enumerate(v), map(is_not, v, repeat(None))))

    def values(self):
        return [x for x in self.v if x is not None]

    def as_dict(self) -> dict:
        v = self.v
        return dict(compress(enumerate(v), map(is_not, v, repeat(None))))

    def copy(self, n: int | None = None) -> "SlotMap":
        """A copy of slots [0, n) (all by default)."""
        return SlotMap(self.v[:n] if n is not None else list(self.v))

    def clear(self) -> None:
        self.v[:] = [None] * len(self.v)

    def __repr__(self) -> str:
        return f"SlotMap({self.as_dict()!r})"


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
        users, parent, tokens, users_of = m.users, m.parent.v, m.tokens.v, m.users_of.v
        mk = tuple.__new__
        out = {}
        for k, s in m.key_slot.items():
            c = creator[s]
            out[k] = mk(Block, (k, k[1] if type(k) is tuple else k, s, parent[s], tokens[s] or (),
                                users[c] if c >= 0 else None, tuple(users_of[s] or ()), hits[s], created[s], last[s]))
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

    def __init__(self, num_blocks: int = 0, offset: int = 0, pod: str = "pod0"):
        self.num_blocks = min(MAX_BLOCKS, max(0, int(num_blocks)))  # grows when an event names a block beyond it
        self.offset = offset  # where block 0 sits in a fleet's numbering (one map per pod)
        self.pod = pod
        cap = max(16, min(self.num_blocks, 1024))  # grows by doubling as blocks are named
        self._alloc(cap)
        self.hw = 0  # 1 + the highest block id ever named
        self.key_slot: dict = {}   # block key (module docstring) -> slot
        self.request: dict[int, str] = {}
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
        self.requests_finished = self.collisions = self.cleared = 0
        self.extra_users = 0  # sum over blocks of max(0, len(users) - 1)
        self.applied = 0  # events applied
        self.version = 0  # bumps with every applied event (views redraw when it moves)
        self.ts: float | None = None
        # wire counters (see the module docstring): the pod's FromWire and subscriber keep them
        self.stored = self.new_blocks = self.reannounced = self.removed = self.removed_unknown = 0
        self.other_medium = self.gaps = self.replayed = self.restarts = self.lost = 0
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
        self.key = SlotMap([None] * cap)       # slot -> block key
        self.parent = SlotMap([None] * cap)    # slot -> its parent's hash (as the source sent it)
        self.tokens = SlotMap([None] * cap)    # slot -> its tokens (a tuple)
        self.users_of = SlotMap([None] * cap)  # slot -> (creator, then users that reused it), in order; replaced, never changed in place (a shallow copy is a snapshot)

    _ARRAYS = ("state", "ref", "creator", "hits", "indexed", "created_at", "last_used")
    _SLOT_MAPS = ("key", "parent", "tokens", "users_of")  # as long as the arrays
    _DICTS = ("key_slot", "request", "_code", "prompt")

    def _grow(self, need: int) -> None:
        cap = len(self.state)
        new = max(need, cap * 2)
        for name in self._ARRAYS:
            old = getattr(self, name)
            arr = np.full(new, -1, old.dtype) if name == "creator" else np.zeros(new, old.dtype)
            arr[:cap] = old
            setattr(self, name, arr)
        for name in self._SLOT_MAPS:
            getattr(self, name).v.extend([None] * (new - cap))  # in place: the apply loop holds the lists
        self._mvs = None

    def _room(self, top: int) -> None:
        if top > self.hw:
            if top > len(self.state):
                self._grow(top)
            self.hw = top
            if top > self.num_blocks:
                self.num_blocks = top

    def _views(self) -> tuple:
        """Memoryviews of the arrays (an item write costs less than numpy's)."""
        v = self._mvs
        if v is None:
            v = self._mvs = tuple(memoryview(getattr(self, n)) for n in
                                  ("state", "ref", "creator", "indexed", "created_at", "last_used", "hits"))
        return v

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
        """An independent copy: arrays and slot maps up to `hw`, dicts of the blocks that hold
        something."""
        m = Mirror.__new__(Mirror)
        m.__dict__.update(self.__dict__)
        cap = max(16, self.hw)
        for name in self._ARRAYS:
            setattr(m, name, getattr(self, name)[:cap].copy())
        for name in self._SLOT_MAPS:
            setattr(m, name, getattr(self, name).copy(cap))
        for name in self._DICTS:
            setattr(m, name, dict(getattr(self, name)))
        m.by_session, m.stored_by_session = Counter(self.by_session), Counter(self.stored_by_session)
        m.users = list(self.users)
        m.held = {r: list(b) for r, b in self.held.items()}
        m.started, m.running, m.waiting = set(self.started), set(self.running), set(self.waiting)
        m._mvs = None
        return m

    # --- what a block's events change ---------------------------------------------------------------
    def _reset(self, b: int) -> None:
        """Forget what block `b` held (it is free now)."""
        kl = self.key.v
        key = kl[b]
        if key is not None:
            kl[b] = None
            if self.key_slot.get(key) == b:
                del self.key_slot[key]
        self.parent.v[b] = None
        self.tokens.v[b] = None
        self.request.pop(b, None)
        ul = self.users_of.v
        users = ul[b]
        ul[b] = None
        if users:
            self.extra_users -= len(users) - 1
            _let_go(self.by_session, users)
        self.creator[b] = -1
        self.hits[b] = 0
        self.indexed[b] = 0
        self.state[b] = FREE

    def _hold(self, rid: str, b: int) -> None:
        """Recordings without ref events: request `rid` holds block `b` (once)."""
        held = self.held.setdefault(rid, [])
        if b not in held:
            held.append(b)
            self.ref[b] += 1
            self.state[b] = IN_USE

    def _rename(self, b: int, key) -> None:
        """Block `b` is to hold `key` (None: none): the key it held lets go of it."""
        kl = self.key.v
        old = kl[b]
        if old is not None and old != key:
            kl[b] = None
            if self.key_slot.get(old) == b:
                del self.key_slot[old]

    def _release(self, rid: str, ts: float) -> None:
        for b in self.held.pop(rid, ()):
            self.ref[b] -= 1
            self.last_used[b] = ts
            if self.ref[b] > 0:
                self.state[b] = IN_USE
            elif self.indexed[b]:
                self.state[b] = CACHED
            else:
                self._reset(b)

    # --- the one entry point: a batch of engine events -------------------------------------------------
    def apply(self, batch: ev_.EngineBatch, start: int = 0, stop: int | None = None) -> None:
        """Apply `batch`'s events [start, stop) in order (all by default; a scrubber's cursor
        stops inside a batch), matching on their types: the pool's one state machine.

        One loop with what it touches held in locals: a busy server's batch is dozens of small
        events, and per-event set-up would cost more than their blocks. Per block only what the
        views read is written; a user's counts are added once per event, and the holders of
        the blocks that go are let go of once per batch (counting is commutative). A store
        into free slots by a user, outside requests and ref events (what a watched server's
        are), takes a shorter loop that writes the same."""
        events = batch.events
        if start or stop is not None:
            events = events[start:stop]
        if not events:
            return
        pod = batch.pod
        off = self.offset
        hw = self.hw
        st, ref, cr, ix, ca, lu, hi = self._views()
        key_slot, request, by_session = self.key_slot, self.request, self.by_session
        key_of, parents, toks, users_of = self.key.v, self.parent.v, self.tokens.v, self.users_of.v  # slot -> ...: lists
        codes = self._code
        Stored, Removed, Hit = ev_.BlockStored, ev_.BlockRemoved, ev_.BlockHit
        extra = 0  # change of extra_users
        let_go: list = []  # the holders of each block that went
        hit = last = None  # the blocks of the latest BlockHit, of the latest BlockStored or BlockHit
        for ev in events:
            cls = ev.__class__
            if cls is Removed or cls is Stored or cls is Hit:
                ids = ev.block_ids
                if not ids:
                    continue
                if off:
                    ids = [b - off for b in ids]
                top = max(ids) + 1
                if top > hw:
                    self._room(top)
                    hw = self.hw
                    st, ref, cr, ix, ca, lu, hi = self._views()
                if cls is Removed:
                    if ev.reason == "evicted":
                        self.evictions += len(ids)
                    for b in ids:
                        ix[b] = 0
                        if ref[b]:
                            continue  # in use: it keeps serving its request, freed when released
                        key = key_of[b]  # what `_reset` does
                        if key is not None:
                            key_of[b] = None
                            s = key_slot.pop(key, b)
                            if s != b:  # the key names another block now: it stays
                                key_slot[key] = s
                        parents[b] = toks[b] = None
                        if request:
                            request.pop(b, None)
                        held = users_of[b]
                        if held is not None:
                            users_of[b] = None
                            let_go.append(held)
                        cr[b] = -1
                        hi[b] = st[b] = 0
                    continue
                ts = ev.ts
                user = ev.user
                one = (user,)
                rid = ev.request_id
                last = ids
                if cls is Hit:
                    hold = rid and not self.exact
                    hit = ids
                    self.hit_tokens += ev.cached_tokens
                    reused = ids
                    for b in ids:
                        if not st[b]:  # a free block holds nothing to reuse (a damaged recording)
                            reused = [b for b in ids if st[b]]
                            continue
                        hi[b] += 1
                        lu[b] = ts
                        if hold:
                            self._hold(rid, b)
                    ids = reused
                else:
                    hashes = ev.block_hashes
                    nh = len(hashes)
                    tokens = tuple(ev.token_ids)  # each block's a slice of it (tuples: the GC stops tracking them)
                    bs = ev.block_size or (len(tokens) // max(1, nh))
                    code = codes.get(user, -1) if user else -1
                    if user and code < 0:
                        code = self.code(user)
                    prev = ev.parent_block_hash
                    o = 0
                    if user and not rid and nh == len(ids) and pod is None and not ev.group_idx and not self.exact \
                            and not self.held:
                        # a user's new blocks outside requests and ref events (no block is held: none has a
                        # ref count, so a slot in use is reused and what it held goes): every write below
                        # is the general loop's for such a block
                        for b, k in zip(ids, hashes):
                            if st[b]:
                                self._reset(b)
                            ca[b] = lu[b] = ts
                            ix[b] = 1
                            key_of[b] = k
                            key_slot[k] = b
                            parents[b] = prev
                            prev = k
                            cr[b] = code
                            toks[b] = tokens[o:o + bs]
                            o += bs
                            users_of[b] = one
                            st[b] = CACHED
                        by_session[user] += len(ids)
                        continue
                    if pod is not None:
                        keys = [(pod, h) for h in hashes]
                    elif ev.group_idx:
                        keys = [(ev.group_idx, h) for h in hashes]
                    else:
                        keys = hashes
                    exact = self.exact
                    hold = rid and not exact
                    for i, b in enumerate(ids):
                        clean = not st[b]  # a free slot holds nothing (what `_reset` leaves): a new block
                        if not clean:
                            if ref[b] or exact:  # allocated to its request (ref events), or in use
                                self._rename(b, keys[i] if i < nh else None)
                            else:  # a slot reused without ref events: what it held goes
                                self._reset(b)
                                clean = True
                        if not exact:
                            ca[b] = lu[b] = ts
                        ix[b] = 1
                        if i < nh:
                            k = keys[i]
                            key_of[b] = k
                            key_slot[k] = b
                            parents[b] = prev
                            prev = hashes[i]
                        cr[b] = code
                        if rid:
                            request[b] = rid
                        elif not clean and request:
                            request.pop(b, None)
                        toks[b] = tokens[o:o + bs]
                        o += bs
                        if hold:
                            self._hold(rid, b)
                        elif not ref[b]:
                            st[b] = CACHED
                if user:  # `user` holds the blocks too: each block's holders are its creator, then who reused it, in order
                    fresh = more = 0
                    for b in ids:
                        held = users_of[b]
                        if held is None:
                            users_of[b] = one
                            fresh += 1
                        elif user not in held:
                            users_of[b] = held + one
                            more += 1
                    if fresh or more:
                        by_session[user] += fresh + more
                        extra += more
            elif cls is ev_.BlocksAllocated or cls is ev_.BlocksTouched or cls is ev_.BlocksReleased:
                self._refs(cls, ev, ev.block_ids if not off else [b - off for b in ev.block_ids])
                hw = self.hw
                st, ref, cr, ix, ca, lu, hi = self._views()
            else:
                if hit is not None:  # a request's start or a clear sets it
                    self.hit = frozenset(hit)
                    hit = None
                self._other(cls, ev)
        if hit is not None:
            self.hit = frozenset(hit)
        if last is not None:
            self.last_blocks = tuple(last)
        if let_go:
            gone = Counter(chain.from_iterable(let_go))
            extra -= sum(gone.values()) - len(let_go)
            for u, c in gone.items():
                c = by_session[u] - c
                if c:
                    by_session[u] = c
                else:
                    del by_session[u]
        self.extra_users += extra
        ts = events[-1].ts
        if ts:
            self.ts = ts
        self.applied += len(events)
        self.version += len(events)

    def _other(self, cls, ev) -> None:
        """The events that change no block: requests, clears (their blocks went in a BlockRemoved
        just before), collisions; the rest (settings, groups, first tokens) change nothing here."""
        if cls is ev_.RequestQueued:
            self.prompt[ev.request_id] = ev.prompt_tokens
            self.waiting.add(ev.request_id)
        elif cls is ev_.RequestStarted:
            rid = ev.request_id
            if rid not in self.started:
                self.started.add(rid)
                self.query_tokens += self.prompt.get(rid, 0)
                if not ev.cached_tokens:
                    self.hit = frozenset()
            self.waiting.discard(rid)
            self.running.add(rid)
        elif cls is ev_.RequestPreempted:
            self.preemptions += 1
            if not self.exact:
                self._release(ev.request_id, ev.ts)
            self.running.discard(ev.request_id)
            self.waiting.add(ev.request_id)
        elif cls is ev_.RequestFinished:
            rid = ev.request_id
            if not self.exact:
                self._release(rid, ev.ts)
            self.running.discard(rid)
            self.waiting.discard(rid)
            self.prompt.pop(rid, None)
            self.started.discard(rid)
            self.requests_finished += 1
        elif cls is ev_.AllBlocksCleared:
            self.hit = frozenset()
            self.cleared += 1
        elif cls is ev_.CollisionCaught:
            self.collisions += 1

    def _refs(self, cls, ev, ids: list) -> None:
        self.exact = True
        if not ids:
            return
        top = max(ids) + 1
        if top > self.hw:
            self._room(top)
        ts = ev.ts
        st, ref, cr, ix, ca, lu, hi = self._views()
        if cls is ev_.BlocksAllocated:
            if len(ids) > 64 and not (self.key or self.users_of):  # bulk: fresh blocks of an empty pool
                idx = np.asarray(ids, np.int64)
                self.ref[idx] = 1
                self.state[idx] = IN_USE
                self.created_at[idx] = ts
                self.last_used[idx] = ts
                return
            kl, ul = self.key.v, self.users_of.v
            for b in ids:
                if st[b] != FREE or kl[b] is not None or ul[b] is not None:
                    self._reset(b)
                ref[b] = 1
                st[b] = IN_USE
                ca[b] = lu[b] = ts
        elif cls is ev_.BlocksTouched:
            for b in ids:
                ref[b] += 1
                st[b] = IN_USE
                lu[b] = ts
        else:
            for b in ids:
                if ref[b] > 0:
                    ref[b] -= 1
                lu[b] = ts
                if ref[b] == 0:
                    if ix[b]:
                        st[b] = CACHED
                    else:
                        self._reset(b)

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
        """With `cells`: blocks [start, stop) in `cells` equal runs (wire/views.summarize; the
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


class Fleet:
    """Mirrors by pod name, each with its translator (`FromWire`), sharing one prompt index (a
    pane's prompt may land on any pod)."""

    def __init__(self):
        self.prompts = PromptIndex()
        self.pods: dict[str, Mirror] = {}
        self.wire: dict[str, FromWire] = {}
        self.lock = threading.RLock()  # held while a batch is applied; views take it to read

    def pod(self, name: str, num_blocks: int = 0, offset: int = 0) -> Mirror:
        m = self.pods.get(name)
        if m is None:
            m = self.pods[name] = Mirror(num_blocks, offset, name)
            self.wire[name] = FromWire(m, self.prompts)
        return m

    def from_wire(self, name: str) -> FromWire:
        """Pod `name`'s translator of its wire batches (made with its mirror)."""
        self.pod(name)
        return self.wire[name]

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

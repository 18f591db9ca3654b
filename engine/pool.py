"""The block pool: per-block metadata, the free queue, the prefix (hash -> block) index, eviction.

A block holds ``block_size`` token slots of K and V for every layer (the tensor is the runner's
``KVStore``). Its state is

- **free**: holds nothing reusable (never filled, or its contents were dropped);
- **cached**: unreferenced but hashed, so a later request with the same prefix can reuse it;
  evictable by the configured policy when a free block is needed;
- **in use**: ref count >= 1 (part of a running request's block table).

The pool never grows: when neither free nor cached blocks remain, allocation fails and the
scheduler preempts. Events are queued here, where state changes, and the engine takes them once
per step (vLLM's block_pool ``kv_event_queue`` and ``take_events()``; `events`, an
engine/events.py `EventQueue`, is shared with the engine's other parts so their order is kept).

Scale: a GPU workstation's pool holds 10^5-10^6 blocks, so nothing here costs O(pool) per step.
Numeric metadata lives in flat arrays (``array.array``, readable as numpy without a copy), one
slot per block; rich data (hash, token ids, extra keys, request id, users seen) lives in dicts
holding only the blocks that have it. ``pool.blocks[i]`` is a light view (``Block``) made on
access, with the attribute names of the old one-object-per-block pool. Never-used blocks are not
queued: they are handed out in id order from a watermark before any recycled block (the order a
queue of every block would give). Counts the app reads 15 times a second (free, cached, in use,
the users-per-block sum behind "dedicated bytes") are kept as counters.
"""
from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Sequence, Set
from typing import Callable

import numpy as np

from .errors import EngineError
from .events import (AllBlocksCleared, BlockRemoved, BlocksAllocated, BlocksReleased, BlocksTouched, BlockStored,
                     EventQueue)
from .eviction import EvictionPolicy, make_policy

FREE, CACHED, IN_USE = "free", "cached", "in_use"
STATES = (FREE, CACHED, IN_USE)  # state codes 0, 1, 2 (BlockPool.state_codes)
_FREE, _CACHED, _IN_USE = 0, 1, 2
_BULK = 32  # allocations at least this big set the arrays through numpy


def _zeros(typecode: str, n: int, fill: int = 0) -> array:
    a = array(typecode, bytes(array(typecode).itemsize * n))
    if fill:
        np.frombuffer(a, dtype=a.typecode)[:] = fill
    return a


class Block:
    """A live view of one block's metadata, made on access (``pool.blocks[i]``)."""
    __slots__ = ("_pool", "block_id")

    def __init__(self, pool: "BlockPool", block_id: int):
        self._pool = pool
        self.block_id = block_id

    @property
    def ref_count(self) -> int:
        return self._pool._ref[self.block_id]

    @property
    def state(self) -> str:
        return STATES[self._pool._state[self.block_id]]

    @property
    def hash(self) -> int | None:  # set once the block is full and registered
        return self._pool._hash[self.block_id]

    @property
    def indexed(self) -> bool:  # True when the prefix index maps `hash` to this block
        return bool(self._pool._indexed[self.block_id])

    @property
    def parent_id(self) -> int | None:
        p = self._pool._parent[self.block_id]
        return None if p < 0 else p

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self._pool.token_ids(self.block_id)

    @property
    def extra(self) -> tuple:
        return self._pool._extra.get(self.block_id, ())

    @property
    def creator(self) -> str | None:
        c = self._pool._creator[self.block_id]
        return None if c < 0 else self._pool.users[c]

    @property
    def creator_request(self) -> str | None:
        return self._pool._request.get(self.block_id)

    @property
    def created_at(self) -> float:
        return self._pool._created_at[self.block_id]

    @property
    def created_seq(self) -> int:
        return self._pool._created_seq[self.block_id]

    @property
    def last_used(self) -> float:
        return self._pool._last_used[self.block_id]

    @property
    def hits(self) -> int:
        return self._pool._hits[self.block_id]

    @property
    def users_seen(self) -> "UsersSeen":  # creator + every user that hit it
        return UsersSeen(self._pool, self.block_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, Block) and other._pool is self._pool and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self._pool), self.block_id))

    def __repr__(self) -> str:
        return (f"Block({self.block_id}, {self.state}, ref={self.ref_count}, indexed={self.indexed}, "
                f"parent={self.parent_id}, creator={self.creator!r}, hits={self.hits})")


class UsersSeen(Set):
    """The users a block has served (a live set; ``add`` goes through ``BlockPool.add_user``)."""
    __slots__ = ("_pool", "_bid")

    def __init__(self, pool: "BlockPool", block_id: int):
        self._pool, self._bid = pool, block_id

    def _set(self):
        return self._pool.users_of(self._bid)

    def __contains__(self, user) -> bool:
        return user in self._set()

    def __iter__(self):
        return iter(self._set())

    def __len__(self) -> int:
        return len(self._set())

    def add(self, user: str) -> None:
        self._pool.add_user(self._bid, user)

    def __repr__(self) -> str:
        return repr(set(self._set()))


class _Blocks(Sequence):
    """``pool.blocks``: a sequence of views, one made per access."""
    __slots__ = ("_pool",)

    def __init__(self, pool: "BlockPool"):
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __getitem__(self, i):
        n = self._pool.num_blocks
        if isinstance(i, slice):
            return [Block(self._pool, b) for b in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return Block(self._pool, i)

    def __iter__(self):
        pool = self._pool
        return (Block(pool, b) for b in range(pool.num_blocks))


class NoFreeBlocks(Exception):
    """Internal: allocation needs more blocks than free + evictable."""


class BlockPool:
    """Block metadata, the free queue, the prefix (hash -> block) index and eviction."""

    def __init__(self, num_blocks: int, block_size: int, eviction: str | EvictionPolicy = "lru",
                 events: EventQueue | None = None, hex_fn: Callable[[int], str] = hex):
        if num_blocks <= 0:
            raise EngineError("the pool needs at least one block")
        n = self.num_blocks = int(num_blocks)
        self.block_size = block_size
        # Per-block numbers, one slot per block (numpy views: state_codes / creator_codes).
        self._ref = _zeros("i", n)
        self._state = _zeros("b", n)  # _FREE / _CACHED / _IN_USE, kept with ref and indexed
        self._indexed = _zeros("b", n)
        self._parent = _zeros("i", n, -1)
        self._creator = _zeros("i", n, -1)  # index into self.users
        self._hits = _zeros("i", n)
        self._created_seq = _zeros("q", n)
        self._created_at = _zeros("d", n)
        self._last_used = _zeros("d", n)
        self._user1 = _zeros("i", n, -1)  # the first user a block served (usually its creator)
        # A full block's token ids, one row per block (calloc'd: untouched rows cost nothing).
        self._tok = np.zeros((n, block_size), dtype=np.int32)
        self._hash: list[int | None] = [None] * n
        # Rarer data, only for blocks that have it.
        self._tokens_odd: dict[int, tuple] = {}  # token ids that do not fill a block (or exceed int32)
        self._extra: dict[int, tuple] = {}
        self._request: dict[int, str] = {}
        self._more_users: dict[int, set] = {}  # users after the first
        self.users: list[str] = []  # user names, by code (creators and users seen; append-only)
        self._user_code: dict[str, int] = {}
        # Free blocks: ids >= _fresh were never used; recycled ones queue after them.
        self._fresh = 0
        self._free: deque[int] = deque()
        self.blocks = _Blocks(self)
        self.index: dict[int, int] = {}
        self.policy = make_policy(eviction) if isinstance(eviction, str) else eviction
        self.events = events if events is not None else EventQueue()
        self.emit = self.events.put  # queue an event (taken by `take_events`)
        self.hex = hex_fn
        self.evictions = 0
        self.extra_users = 0  # sum over blocks of max(0, len(users_seen) - 1)
        self._seq = 0
        # indexed parent -> its indexed child, or a set of them when it has several (rare)
        self.children: dict[int, int | set[int]] = {}
        # called with (dropped, reason, ts, by user, policy) whenever blocks leave the index
        self.on_removed: Callable[[list, str, float, str, str], None] | None = None

    # --- queries ----------------------------------------------------------------------------
    def num_free(self) -> int:
        return self.num_blocks - self._fresh + len(self._free)

    def num_cached(self) -> int:
        return len(self.policy)

    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free() - self.num_cached()

    def num_resident(self) -> int:
        """Blocks holding something (cached or in use)."""
        return self.num_blocks - self.num_free()

    def num_dedicated(self) -> int:
        """Blocks a cache without sharing would hold: sum over resident blocks of
        max(1, len(users_seen)) (free blocks have no users)."""
        return self.num_resident() + self.extra_users

    def available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.num_free() + len(self.policy)

    def free_ids(self) -> list[int]:
        """The free queue in allocation order (O(free): for tests and tools, not per step)."""
        return [*range(self._fresh, self.num_blocks), *self._free]

    def token_ids(self, bid: int) -> tuple[int, ...]:
        if self._hash[bid] is None:
            return ()
        odd = self._tokens_odd.get(bid)
        return odd if odd is not None else tuple(self._tok[bid].tolist())

    def users_of(self, bid: int) -> tuple[str, ...]:
        """The users block `bid` served, first one first (see add_user)."""
        first = self._user1[bid]
        if first < 0:
            return ()
        more = self._more_users.get(bid)
        return (self.users[first], *more) if more else (self.users[first],)

    def lookup(self, block_hash: int) -> Block | None:
        bid = self.index.get(block_hash)
        return None if bid is None else Block(self, bid)

    def state_codes(self) -> np.ndarray:
        """Per-block state codes (index into STATES), a numpy view of the live array: copy it."""
        return np.frombuffer(self._state, dtype=np.int8)

    def creator_codes(self) -> np.ndarray:
        """Per-block creator codes (index into `users`, -1 none), a live numpy view: copy it."""
        return np.frombuffer(self._creator, dtype=np.int32)

    def user_code(self, user: str) -> int:
        code = self._user_code.get(user)
        if code is None:
            code = self._user_code[user] = len(self.users)
            self.users.append(user)
        return code

    def take_events(self) -> list:
        """The events queued since the last call, in order (vLLM's ``take_events()``)."""
        return self.events.take()

    # --- state changes ------------------------------------------------------------------------
    def allocate(self, n: int, now: float | None = None, by: tuple[str, str] | None = None) -> list[int]:
        """Take `n` blocks (ref 1), evicting cached ones when no free block is left. `by`: the
        (user, request id) the blocks are for, named in the BlockRemoved of what they evict."""
        if n > self.available():
            raise NoFreeBlocks(n)
        now = time.time() if now is None else now
        fresh = min(n, self.num_blocks - self._fresh)
        out = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        evicted: list = []
        for _ in range(n - fresh):
            if not self._free:
                self._unindex(self.policy.pick(self.blocks), evicted)  # -> the free queue
            out.append(self._free.popleft())
        # Free blocks are already reset (when freed); set what an allocation sets.
        if n >= _BULK:
            idx = np.asarray(out, dtype=np.int64)
            np.frombuffer(self._ref, np.int32)[idx] = 1
            np.frombuffer(self._state, np.int8)[idx] = _IN_USE
            np.frombuffer(self._created_at, np.float64)[idx] = now
            np.frombuffer(self._last_used, np.float64)[idx] = now
            np.frombuffer(self._created_seq, np.int64)[idx] = np.arange(self._seq + 1, self._seq + 1 + n)
            self._seq += n
        else:
            ref, state, cat, lu, cseq = self._ref, self._state, self._created_at, self._last_used, self._created_seq
            for bid in out:
                ref[bid] = 1
                state[bid] = _IN_USE
                cat[bid] = lu[bid] = now
                self._seq += 1
                cseq[bid] = self._seq
        if evicted:
            self.evictions += len(evicted)
            self._emit_removed(evicted, "evicted", now, by)
        if out:
            self.emit(BlocksAllocated(block_ids=out[:]))
        return out

    def _reset(self, bid: int) -> None:
        """Forget what an unreferenced block held (it is about to join the free queue)."""
        self._hash[bid] = None
        self._tokens_odd.pop(bid, None)
        self._extra.pop(bid, None)
        self._request.pop(bid, None)
        more = self._more_users.pop(bid, None)
        if more:
            self.extra_users -= len(more)
        self._user1[bid] = -1
        self._indexed[bid] = 0
        self._parent[bid] = -1
        self._creator[bid] = -1
        self._hits[bid] = 0
        self._state[bid] = _FREE

    def _is_index_holder(self, bid: int) -> bool:
        return bool(self._indexed[bid]) and self.index.get(self._hash[bid]) == bid

    def _unindex(self, bid: int, dropped: list) -> None:
        """Take `bid` and every indexed descendant out of the prefix index.

        A descendant is only reachable through its parent, so it goes too (FIFO evicts parents
        first; a clear unindexes blocks in use). Unreferenced blocks return to the free queue;
        blocks in use keep serving their request and are freed when released.
        """
        stack = [bid]
        while stack:
            b = stack.pop()
            if not self._indexed[b]:
                continue
            h = self._hash[b]
            c = self._creator[b]
            dropped.append((h, b, self.users[c] if c >= 0 else ""))
            if self.index.get(h) == b:
                del self.index[h]
            self._indexed[b] = 0
            p = self._parent[b]
            if p >= 0:
                self._drop_child(p, b)
            stack.extend(self._children_of(b))
            self.children.pop(b, None)
            if self._ref[b] == 0:
                self.policy.remove(b)
                self._reset(b)
                self._free.append(b)

    def _add_child(self, parent: int, child: int) -> None:
        kids = self.children.get(parent)
        if kids is None:
            self.children[parent] = child
        elif isinstance(kids, set):
            kids.add(child)
        elif kids != child:
            self.children[parent] = {kids, child}

    def _drop_child(self, parent: int, child: int) -> None:
        kids = self.children.get(parent)
        if kids == child:
            del self.children[parent]
        elif isinstance(kids, set):
            kids.discard(child)
            if len(kids) == 1:
                self.children[parent] = next(iter(kids))
            elif not kids:
                del self.children[parent]

    def _children_of(self, parent: int) -> tuple[int, ...]:
        kids = self.children.get(parent)
        return () if kids is None else tuple(kids) if isinstance(kids, set) else (kids,)

    def _emit_removed(self, dropped: list, reason: str, now: float | None = None,
                      by: tuple[str, str] | None = None) -> None:
        """`dropped`: (hash, block id, creator) of the blocks that left the index."""
        policy = self.policy.name if reason == "evicted" else ""
        user, rid = by or ("", "")
        if self.on_removed is not None:  # the KV manager's miss attribution (engine/miss.py)
            self.on_removed(dropped, reason, time.time() if now is None else now, user, policy)
        hex_ = self.hex
        self.emit(BlockRemoved(block_hashes=[hex_(h) for h, _, _ in dropped], block_ids=[b for _, b, _ in dropped],
                               creators=[c for _, _, c in dropped], reason=reason, by_user=user, by_request=rid,
                               policy=policy))

    def touch(self, block_ids: list[int], now: float | None = None, *, hit: bool = True) -> None:
        """A request reuses these cached/in-use blocks: ref += 1, and hit += 1 unless `hit` is
        False (a preempted request re-admitted re-references its blocks without a new hit)."""
        now = time.time() if now is None else now
        ref, hits = self._ref, self._hits
        for bid in block_ids:
            if ref[bid] == 0:
                self.policy.remove(bid)
                self._state[bid] = _IN_USE
            ref[bid] += 1
            if hit:
                hits[bid] += 1
            self._last_used[bid] = now
        if block_ids:
            self.emit(BlocksTouched(block_ids=list(block_ids)))

    def add_user(self, bid: int, user: str) -> None:
        """`user` is served by block `bid` (its creator, or a request that hit it)."""
        code = self.user_code(user)
        first = self._user1[bid]
        if first < 0:
            self._user1[bid] = code
        elif first != code:
            more = self._more_users.get(bid)
            if more is None:
                self._more_users[bid] = {user}
            elif user not in more:
                more.add(user)
            else:
                return
            self.extra_users += 1

    def register(self, bid: int, block_hash: int, parent_id: int | None, tokens, extra,
                 user: str, request_id: str) -> bool:
        """Mark a just-filled block as holding `tokens`; index it if it can be reached.

        Returns True when the block entered the index (a BlockStored event is emitted). It stays
        unindexed, and returns to the free queue when released, when its hash is already
        indexed (a duplicate computed concurrently, as in vLLM) or when its parent is not the
        indexed holder of the parent's hash (after a clear, or a duplicate's child): then no
        lookup could reach it with the parent verify-on-hit expects.
        """
        tokens = tuple(tokens)
        self._hash[bid] = block_hash
        self._parent[bid] = -1 if parent_id is None else parent_id
        try:
            if len(tokens) != self.block_size:
                raise ValueError
            self._tok[bid] = tokens  # token ids are never negative; > int32 raises OverflowError
            self._tokens_odd.pop(bid, None)
        except (ValueError, OverflowError):
            self._tokens_odd[bid] = tokens
        extra = tuple(extra)
        if extra:
            self._extra[bid] = extra
        else:
            self._extra.pop(bid, None)
        self._creator[bid] = self.user_code(user) if user is not None else -1
        self._request[bid] = request_id
        if block_hash in self.index or (parent_id is not None and not self._is_index_holder(parent_id)):
            return False
        self.index[block_hash] = bid
        self._indexed[bid] = 1
        if parent_id is not None:
            self._add_child(parent_id, bid)
        parent_hash = self._hash[parent_id] if parent_id is not None else None
        self.emit(BlockStored(block_hashes=[self.hex(block_hash)],
                              parent_block_hash=None if parent_hash is None else self.hex(parent_hash),
                              token_ids=list(tokens), block_size=self.block_size, block_ids=[bid],
                              user=user, request_id=request_id, extra_keys=[[list(k) for k in extra]]))
        return True

    def release(self, block_ids: list[int], now: float | None = None) -> None:
        """Drop one reference from each block, tail first (so LRU evicts a chain's tail first)."""
        now = time.time() if now is None else now
        ref = self._ref
        for bid in reversed(block_ids):
            if ref[bid] <= 0:
                raise AssertionError(f"double free of block {bid}")
            ref[bid] -= 1
            self._last_used[bid] = now
            if ref[bid] == 0:
                if self._indexed[bid]:
                    self._state[bid] = _CACHED
                    self.policy.add(Block(self, bid))
                else:
                    self._reset(bid)
                    self._free.append(bid)
        if block_ids:
            self.emit(BlocksReleased(block_ids=list(block_ids)))

    def clear(self, reason: str = "cleared") -> int:
        """Empty the prefix index: cached blocks become free; blocks in use keep their contents
        for their request but can no longer be hit. Returns how many cached blocks were dropped.

        Costs O(indexed blocks), not O(pool), and works in bulk: every cached block is indexed,
        so nothing stays evictable. The BlockRemoved event lists the blocks root by root (in id
        order), each followed by its descendants, depth first (as evicting each root would)."""
        order: list[int] = []
        seen: set[int] = set()
        roots = sorted(b for b in self.index.values() if self._parent[b] < 0)
        for root in [*roots, *sorted(self.index.values())]:  # then anything left (should be nothing)
            stack = [root]
            while stack:
                b = stack.pop()
                if b in seen:
                    continue
                seen.add(b)
                order.append(b)
                stack.extend(self._children_of(b))
        if order:
            users, hashes, creator = self.users, self._hash, self._creator
            dropped = [(hashes[b], b, users[creator[b]] if creator[b] >= 0 else "") for b in order]
            idx = np.asarray(order, dtype=np.int64)
            np.frombuffer(self._indexed, np.int8)[idx] = 0
            freed = idx[np.frombuffer(self._ref, np.int32)[idx] == 0]
            self.index.clear()
            self.children.clear()
            self.policy.clear()
            for b in freed.tolist():
                hashes[b] = None
                self._tokens_odd.pop(b, None)
                self._extra.pop(b, None)
                self._request.pop(b, None)
                more = self._more_users.pop(b, None)
                if more:
                    self.extra_users -= len(more)
            for arr, dtype, value in ((self._parent, np.int32, -1), (self._creator, np.int32, -1),
                                      (self._user1, np.int32, -1), (self._hits, np.int32, 0),
                                      (self._state, np.int8, _FREE)):
                np.frombuffer(arr, dtype)[freed] = value
            self._free.extend(freed.tolist())
            self._emit_removed(dropped, reason)
        else:
            freed = ()
        self.emit(AllBlocksCleared(reason=reason))
        return len(freed)

    def set_policy(self, policy: EvictionPolicy) -> None:
        for bid in self.policy.ids():
            policy.add(Block(self, bid))
        self.policy = policy

    def check(self) -> None:
        """Invariants (used by tests, O(pool)): every block is in exactly one place, the state
        codes and counters agree with a recount."""
        free_list = self.free_ids()
        free = set(free_list)
        assert len(free) == len(free_list), "duplicate in free queue"
        assert all(b < self._fresh for b in self._free), "a never-used block in the recycled queue"
        evictable = set(self.policy.ids())
        assert len(evictable) == len(self.policy)
        assert not (free & evictable), "block both free and evictable"
        extra = 0
        for blk in self.blocks:
            b = blk.block_id
            if blk.ref_count > 0:
                assert b not in free and b not in evictable, blk
                assert self._state[b] == _IN_USE, blk
            elif blk.indexed:
                assert b in evictable, blk
                assert self._state[b] == _CACHED, blk
            else:
                assert b in free, blk
                assert self._state[b] == _FREE, blk
                assert blk.hash is None and not blk.token_ids and not blk.users_seen and blk.hits == 0, blk
            if blk.indexed:
                assert self.index.get(blk.hash) == b, blk
            extra += max(0, len(blk.users_seen) - 1)
        assert extra == self.extra_users, (extra, self.extra_users)
        for h, bid in self.index.items():
            assert self._hash[bid] == h and self._indexed[bid]
            parent = Block(self, bid).parent_id
            # an indexed block is reachable: its parent holds the parent's hash in the index
            assert parent is None or self._is_index_holder(parent), Block(self, bid)
            assert parent is None or bid in self._children_of(parent), Block(self, bid)
        for parent, kids in self.children.items():
            assert not isinstance(kids, set) or len(kids) > 1, (parent, kids)

"""The block pool: one pre-allocated K/V tensor for all layers, plus per-block metadata.

A block holds ``block_size`` token slots of K and V for every layer. Its state is

- **free**: holds nothing reusable (never filled, or its contents were dropped);
- **cached**: unreferenced but hashed, so a later request with the same prefix can reuse it;
  evictable by the configured policy when a free block is needed;
- **in use**: ref count >= 1 (part of a running request's block table).

The pool never grows: when neither free nor cached blocks remain, allocation fails and the
scheduler preempts. Events are emitted here, where state changes (vLLM's block_pool style).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .errors import EngineError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from .eviction import EvictionPolicy, make_policy

FREE, CACHED, IN_USE = "free", "cached", "in_use"


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered
    indexed: bool = False  # True when the prefix index maps `hash` to this block
    parent_id: int | None = None
    token_ids: tuple[int, ...] = ()
    extra: tuple = ()
    creator: str | None = None
    creator_request: str | None = None
    created_at: float = 0.0
    created_seq: int = 0
    last_used: float = 0.0
    hits: int = 0
    users_seen: set = field(default_factory=set)  # creator + every user that hit it

    @property
    def state(self) -> str:
        if self.ref_count > 0:
            return IN_USE
        return CACHED if self.indexed else FREE

    def reset(self) -> None:
        self.hash = None
        self.indexed = False
        self.parent_id = None
        self.token_ids = ()
        self.extra = ()
        self.creator = None
        self.creator_request = None
        self.hits = 0
        self.users_seen = set()


class NoFreeBlocks(Exception):
    """Internal: allocation needs more blocks than free + evictable."""


@dataclass
class KVStore:
    """K/V storage for every layer: tensor [layers, 2, num_blocks * block_size, kv_heads, head_dim]."""
    num_blocks: int
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: object
    device: object
    data: object = field(init=False)

    def __post_init__(self):
        import torch

        slots = self.num_blocks * self.block_size
        self.data = torch.zeros((self.num_layers, 2, slots, self.kv_heads, self.head_dim),
                                dtype=self.dtype, device=self.device)

    @staticmethod
    def bytes_per_block(block_size, num_layers, kv_heads, head_dim, dtype) -> int:
        import torch

        elt = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * kv_heads * head_dim * elt

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(self.block_size, self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks


class BlockPool:
    """Block metadata, the free queue, the prefix (hash -> block) index and eviction."""

    def __init__(self, num_blocks: int, block_size: int, eviction: str | EvictionPolicy = "lru",
                 emit: Callable[[Event], None] | None = None, hex_fn: Callable[[int], str] = hex):
        if num_blocks <= 0:
            raise EngineError("the pool needs at least one block")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.index: dict[int, int] = {}
        self.policy = make_policy(eviction) if isinstance(eviction, str) else eviction
        self.emit = emit or (lambda e: None)
        self.hex = hex_fn
        self.evictions = 0
        self._seq = 0
        self.dirty: set[int] = set(range(num_blocks))  # blocks changed since the last snapshot
        self.children: dict[int, set[int]] = {}  # indexed parent -> its indexed children

    # --- queries ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def num_free(self) -> int:
        return len(self.free)

    def num_cached(self) -> int:
        return len(self.policy)

    def num_in_use(self) -> int:
        return self.num_blocks - self.num_free() - self.num_cached()

    def available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return len(self.free) + len(self.policy)

    def lookup(self, block_hash: int) -> Block | None:
        bid = self.index.get(block_hash)
        return None if bid is None else self.blocks[bid]

    # --- state changes ------------------------------------------------------------------------
    def allocate(self, n: int, now: float | None = None) -> list[int]:
        """Take `n` blocks (ref 1), evicting cached ones when no free block is left."""
        if n > self.available():
            raise NoFreeBlocks(n)
        now = time.time() if now is None else now
        out, evicted = [], []
        for _ in range(n):
            if not self.free:
                self._unindex(self.policy.pick(self.blocks), evicted)  # -> the free queue
            bid = self.free.popleft()
            blk = self.blocks[bid]
            self.dirty.add(bid)
            blk.reset()
            blk.ref_count = 1
            blk.created_at = blk.last_used = now
            self._seq += 1
            blk.created_seq = self._seq
            out.append(bid)
        if evicted:
            self.evictions += len(evicted)
            self._emit_removed(evicted, "evicted")
        return out

    def _is_index_holder(self, bid: int) -> bool:
        blk = self.blocks[bid]
        return blk.indexed and self.index.get(blk.hash) == bid

    def _unindex(self, bid: int, dropped: list) -> None:
        """Take `bid` and every indexed descendant out of the prefix index.

        A descendant is only reachable through its parent, so it goes too (FIFO evicts parents
        first; a clear unindexes blocks in use). Unreferenced blocks return to the free queue;
        blocks in use keep serving their request and are freed when released.
        """
        stack = [bid]
        while stack:
            b = stack.pop()
            blk = self.blocks[b]
            if not blk.indexed:
                continue
            dropped.append((self.hex(blk.hash), b, blk.creator or ""))
            if self.index.get(blk.hash) == b:
                del self.index[blk.hash]
            blk.indexed = False
            self.dirty.add(b)
            if blk.parent_id is not None:
                self.children.get(blk.parent_id, set()).discard(b)
            stack.extend(self.children.pop(b, ()))
            if blk.ref_count == 0:
                self.policy.remove(b)
                blk.reset()
                self.free.append(b)

    def _emit_removed(self, dropped: list, reason: str) -> None:
        self.emit(BlockRemoved(block_hashes=[h for h, _, _ in dropped], block_ids=[b for _, b, _ in dropped],
                               creators=[c for _, _, c in dropped], reason=reason))

    def touch(self, block_ids: list[int], now: float | None = None, *, hit: bool = True) -> None:
        """A request reuses these cached/in-use blocks: ref += 1, and hit += 1 unless `hit` is
        False (a preempted request re-admitted re-references its blocks without a new hit)."""
        now = time.time() if now is None else now
        self.dirty.update(block_ids)
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                self.policy.remove(bid)
            blk.ref_count += 1
            if hit:
                blk.hits += 1
            blk.last_used = now

    def register(self, bid: int, block_hash: int, parent_id: int | None, tokens, extra,
                 user: str, request_id: str) -> bool:
        """Mark a just-filled block as holding `tokens`; index it if it can be reached.

        Returns True when the block entered the index (a BlockStored event is emitted). It stays
        unindexed, and returns to the free queue when released, when its hash is already
        indexed (a duplicate computed concurrently, as in vLLM) or when its parent is not the
        indexed holder of the parent's hash (after a clear, or a duplicate's child): then no
        lookup could reach it with the parent verify-on-hit expects.
        """
        blk = self.blocks[bid]
        self.dirty.add(bid)
        blk.hash, blk.parent_id = block_hash, parent_id
        blk.token_ids, blk.extra = tuple(tokens), tuple(extra)
        blk.creator, blk.creator_request = user, request_id
        if block_hash in self.index or (parent_id is not None and not self._is_index_holder(parent_id)):
            return False
        self.index[block_hash] = bid
        blk.indexed = True
        if parent_id is not None:
            self.children.setdefault(parent_id, set()).add(bid)
        parent_hash = self.blocks[parent_id].hash if parent_id is not None else None
        self.emit(BlockStored(block_hashes=[self.hex(block_hash)],
                              parent_block_hash=None if parent_hash is None else self.hex(parent_hash),
                              token_ids=list(tokens), block_size=self.block_size, block_ids=[bid],
                              user=user, request_id=request_id))
        return True

    def release(self, block_ids: list[int], now: float | None = None) -> None:
        """Drop one reference from each block, tail first (so LRU evicts a chain's tail first)."""
        now = time.time() if now is None else now
        self.dirty.update(block_ids)
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise AssertionError(f"double free of block {bid}")
            blk.ref_count -= 1
            blk.last_used = now
            if blk.ref_count == 0:
                if blk.indexed:
                    self.policy.add(blk)
                else:
                    blk.reset()
                    self.free.append(bid)

    def clear(self, reason: str = "cleared") -> int:
        """Empty the prefix index: cached blocks become free; blocks in use keep their contents
        for their request but can no longer be hit. Returns how many cached blocks were dropped."""
        dropped: list = []
        for bid in [b for b, blk in enumerate(self.blocks) if blk.indexed and blk.parent_id is None]:
            self._unindex(bid, dropped)
        for blk in self.blocks:  # anything left (should be nothing): unindex it too
            if blk.indexed:
                self._unindex(blk.block_id, dropped)
        if dropped:
            self._emit_removed(dropped, reason)
        self.emit(AllBlocksCleared(reason=reason))
        return sum(1 for _, b, _ in dropped if self.blocks[b].ref_count == 0)

    def set_policy(self, policy: EvictionPolicy) -> None:
        for bid in self.policy.ids():
            policy.add(self.blocks[bid])
        self.policy = policy

    def check(self) -> None:
        """Invariants (used by tests): every block is in exactly one place, counts agree."""
        free = set(self.free)
        assert len(free) == len(self.free), "duplicate in free queue"
        evictable = set(self.policy.ids())
        assert not (free & evictable), "block both free and evictable"
        for blk in self.blocks:
            if blk.ref_count > 0:
                assert blk.block_id not in free and blk.block_id not in evictable, blk
            elif blk.indexed:
                assert blk.block_id in evictable, blk
            else:
                assert blk.block_id in free, blk
            if blk.indexed:
                assert self.index.get(blk.hash) == blk.block_id, blk
        for h, bid in self.index.items():
            assert self.blocks[bid].hash == h and self.blocks[bid].indexed
            parent = self.blocks[bid].parent_id
            # an indexed block is reachable: its parent holds the parent's hash in the index
            assert parent is None or self._is_index_holder(parent), self.blocks[bid]
            assert parent is None or bid in self.children.get(parent, ()), self.blocks[bid]

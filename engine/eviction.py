"""Eviction policies over *cached* blocks: unreferenced, hashed, still holding reusable K/V.

Free (never-filled) blocks are always used first; a policy only picks which cached block gives
up its contents when none is free. Every operation costs O(1) (LRU) or O(log cached) amortised
(LFU, FIFO), whatever the pool size.

Eviction order (tests/engine/test_pool_scale.py checks each against a brute-force reference):

- ``lru``  (default): least recently used first, i.e. the block that became evictable earliest.
  Like vLLM, when a request releases its chain the blocks are released tail-first, so among
  blocks released together the deepest (least shareable) one goes before its parents.
- ``lfu``: fewest hits first; ties go to the block that became evictable earliest (LRU).
- ``fifo``: oldest created first (smallest ``created_seq``), whatever its use.

A block's ``hits`` and ``created_seq`` cannot change while it is evictable (a hit takes it out of
the set first), so LFU and FIFO keep a heap keyed at ``add`` time; a removal only forgets the
block, and its stale heap entry is skipped when it reaches the top (the heap is rebuilt when
stale entries outnumber live ones).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import TYPE_CHECKING

from .errors import EngineError

if TYPE_CHECKING:  # pragma: no cover
    from .pool import Block


class EvictionPolicy:
    name = "base"

    def __init__(self) -> None:
        # block_id -> entry, in the order blocks became evictable (OrderedDict = O(1) remove).
        self._evictable: "OrderedDict[int, object]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._evictable

    def add(self, block: "Block") -> None:
        """`block` became unreferenced and stays cached."""
        self._evictable[block.block_id] = None

    def remove(self, block_id: int) -> None:
        """`block` was hit again (or cleared); it is no longer a candidate."""
        self._evictable.pop(block_id, None)

    def ids(self) -> list[int]:
        """The evictable blocks, in the order they became evictable."""
        return list(self._evictable)

    def clear(self) -> None:
        """Forget every block (the pool's clear: no cached block stays)."""
        self._evictable.clear()

    def pick(self, blocks) -> int:
        """Return the id of the block to evict next (and forget it)."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def pick(self, blocks=None):
        block_id, _ = self._evictable.popitem(last=False)
        return block_id


class _HeapPolicy(EvictionPolicy):
    """Evicts the block with the smallest key(block); entries: [key..., tick, block_id]."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[list] = []
        self._tick = 0  # counts adds: the order blocks became evictable

    def key(self, block: "Block") -> int:
        raise NotImplementedError

    def add(self, block: "Block") -> None:
        self._tick += 1
        entry = [self.key(block), self._tick, block.block_id]
        self._evictable.pop(block.block_id, None)
        self._evictable[block.block_id] = entry
        heapq.heappush(self._heap, entry)

    def clear(self) -> None:
        super().clear()
        self._heap.clear()

    def remove(self, block_id: int) -> None:
        if self._evictable.pop(block_id, None) is not None and len(self._heap) > 2 * len(self._evictable) + 64:
            self._heap = list(self._evictable.values())  # drop stale entries
            heapq.heapify(self._heap)

    def pick(self, blocks=None) -> int:
        while True:
            entry = heapq.heappop(self._heap)  # IndexError when empty, like popitem on {}
            block_id = entry[2]
            if self._evictable.get(block_id) is entry:
                del self._evictable[block_id]
                return block_id


class LFU(_HeapPolicy):
    name = "lfu"

    def key(self, block):
        return block.hits  # ties: smaller tick = became evictable earlier (LRU)


class FIFO(_HeapPolicy):
    name = "fifo"

    def key(self, block):
        return block.created_seq  # unique per allocation


POLICIES = {cls.name: cls for cls in (LRU, LFU, FIFO)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise EngineError(f"unknown eviction policy {name!r} ({', '.join(POLICIES)})") from None

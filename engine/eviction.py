"""Eviction policies over *cached* blocks: unreferenced, hashed, still holding reusable K/V.

Free (never-filled) blocks are always used first; a policy only picks which cached block gives
up its contents when none is free.

- ``lru``  (default): least recently used first. Like vLLM, when a request releases its chain
  the blocks are touched tail-first, so among blocks released together the deepest (least
  shareable) one goes before its parents.
- ``lfu``: fewest hits first, ties broken by LRU.
- ``fifo``: oldest created first, whatever its use.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from .errors import EngineError

if TYPE_CHECKING:  # pragma: no cover
    from .pool import Block


class EvictionPolicy:
    name = "base"

    def __init__(self) -> None:
        # block_id -> None, in the order blocks became evictable (OrderedDict = O(1) remove).
        self._evictable: "OrderedDict[int, None]" = OrderedDict()

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
        return list(self._evictable)

    def pick(self, blocks: list["Block"]) -> int:
        """Return the id of the block to evict next (and forget it)."""
        raise NotImplementedError


class LRU(EvictionPolicy):
    name = "lru"

    def pick(self, blocks):
        block_id, _ = self._evictable.popitem(last=False)
        return block_id


class LFU(EvictionPolicy):
    name = "lfu"

    def pick(self, blocks):
        # Insertion order is LRU order, and min() keeps the first of equals: LFU, ties by LRU.
        block_id = min(self._evictable, key=lambda b: blocks[b].hits)
        del self._evictable[block_id]
        return block_id


class FIFO(EvictionPolicy):
    name = "fifo"

    def pick(self, blocks):
        block_id = min(self._evictable, key=lambda b: blocks[b].created_seq)
        del self._evictable[block_id]
        return block_id


POLICIES = {cls.name: cls for cls in (LRU, LFU, FIFO)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise EngineError(f"unknown eviction policy {name!r} ({', '.join(POLICIES)})") from None

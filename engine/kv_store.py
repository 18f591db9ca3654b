"""The K/V tensor: one pre-allocated store for every layer, addressed by flat slot
(block_id * block_size + offset). The pool (pool.py) owns which block holds what; this module
owns the memory.

The store is allocated with ``torch.empty``: a slot is always written (by the runner's
``index_copy_`` of a step's new tokens) before any query reads it, because a row gathers only
positions < past_len + its new tokens, and past positions were written by the step that computed
them (or by the request that created a cached block). So a pool of a million blocks is ready as
soon as the allocator returns, without touching its pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVStore:
    """K/V storage for every layer: tensor [layers, 2, kv_heads, num_blocks * block_size, head_dim].
    Head-major: a request's keys for one head are consecutive in memory when its blocks are (a
    decode step's attention read them ~1.5x faster than slot-major on the 2-core machine)."""
    num_blocks: int
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: object
    device: object
    data: object = field(init=False)

    def __post_init__(self):
        slots = self.num_blocks * self.block_size
        self.data = torch.empty((self.num_layers, 2, self.kv_heads, slots, self.head_dim),
                                dtype=self.dtype, device=self.device)

    @staticmethod
    def bytes_per_block(block_size, num_layers, kv_heads, head_dim, dtype) -> int:
        elt = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * kv_heads * head_dim * elt

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_block(self.block_size, self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

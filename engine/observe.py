"""The engine's counters and the shapes the cache views share.

Views (the block map, stats, scrubber, attach) read a mirror of the engine's events
(wire/mirror.Mirror), never the engine's pool; what is here:

- ``Engine.stats(timeout=1.0) -> dict``: O(1) counters (kept incrementally by the pool and
  scheduler), for the CLI, the server's /metrics and the bench. Waits up to `timeout` s for the
  current step to end; on timeout returns the copy published after the last step.
- ``BlockView``: one block's picture (a mirror's ``block(i)``; ``block_view(pool, i)`` reads the
  live pool, for tests and tools).
- ``BlockArrays`` / ``BlockSummary`` / ``summarize``: a range of blocks as state and creator
  codes, and split into `cells` equal runs (counts of free, cached and in-use blocks, the
  dominant state, ties in_use > cached > free, the dominant creator among non-free blocks and,
  with `user`, that user's non-free blocks per cell): the block map's one call per redraw,
  numpy work, no per-block Python. ``Engine.block_arrays`` / ``block_summary`` compute them from
  the live pool (lock-free; for the bench and tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .pool import STATES, BlockPool

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


@dataclass(frozen=True)
class BlockView:
    """An immutable picture of one block, for the block map."""
    block_id: int
    state: str  # free | cached | in_use
    ref_count: int
    hash: str | None
    creator: str | None
    creator_request: str | None
    token_ids: tuple[int, ...]
    hits: int
    created_at: float
    last_used: float
    users: tuple[str, ...]


def block_view(pool: BlockPool, bid: int) -> BlockView:
    b = pool.blocks[bid]
    h = b.hash
    return BlockView(bid, b.state, b.ref_count, None if h is None else pool.hex(h), b.creator, b.creator_request,
                     b.token_ids, b.hits, b.created_at, b.last_used, tuple(sorted(b.users_seen)))


@dataclass(frozen=True)
class BlockArrays:
    version: int  # the last published version when the copy was taken
    start: int  # block id of state[0]
    state: np.ndarray  # int8 per block, index into STATES
    creator: np.ndarray  # int32 per block, index into users (-1: none)
    users: tuple[str, ...]
    states: tuple[str, ...] = STATES


@dataclass(frozen=True)
class BlockSummary:
    version: int
    start: int
    stop: int
    bounds: np.ndarray  # int64, cells + 1 block ids: cell k is blocks bounds[k]:bounds[k+1]
    free: np.ndarray  # int64 counts per cell
    cached: np.ndarray
    in_use: np.ndarray
    state: np.ndarray  # int8 dominant state code per cell (ties: in_use > cached > free)
    creator: np.ndarray  # int32 dominant creator code among non-free blocks (-1: none)
    users: tuple[str, ...]
    mine: np.ndarray | None = None  # with `user`: non-free blocks that user created, per cell
    states: tuple[str, ...] = STATES

    @property
    def cells(self) -> int:
        return len(self.bounds) - 1


_cell_base: tuple = ()  # (n, cells, width, base): the last shape's cell id * width per block


def _cell_keys_base(n: int, cells: int, width: int, offsets: np.ndarray) -> np.ndarray:
    """cell id * width for each of n blocks (cached for the last shape: a map asks the same)."""
    global _cell_base
    cached = _cell_base
    if cached and cached[:3] == (n, cells, width):
        return cached[3]
    base = np.repeat(np.arange(cells, dtype=np.int64) * width, np.diff(offsets))
    _cell_base = (n, cells, width, base)
    return base


def summarize(arrays: BlockArrays, cells: int, user: str | None = None, total: int | None = None) -> BlockSummary:
    """Aggregate `arrays` into `cells` equal runs of blocks (see the module docstring).

    One histogram over (cell, state, creator) of the non-free blocks (of every block when most
    are in use): numpy work, ~10 ms at 10^6 blocks on a busy 2-core box, no per-block Python.
    With `total` (>= len(arrays.state)) the range is `total` blocks long, those past the arrays
    free: a mirror passes only the part of a huge pool ever used, if most of the range is free."""
    state, creator = arrays.state, arrays.creator
    n = len(state) if total is None else max(total, len(state))
    start = arrays.start
    cells = max(1, min(int(cells), n)) if n else 0
    if not cells:
        empty = np.zeros(0, np.int64)
        return BlockSummary(arrays.version, start, start, np.array([start], np.int64), empty, empty, empty,
                            empty.astype(np.int8), empty.astype(np.int32), arrays.users,
                            empty if user is not None else None)
    offsets = (np.arange(cells + 1, dtype=np.int64) * n) // cells  # cell k: offsets[k]:offsets[k+1]
    if total is not None and np.count_nonzero(state) * 4 >= n and len(state) < n:  # mostly used: pad
        state = np.concatenate([state, np.zeros(n - len(state), state.dtype)])
        creator = np.concatenate([creator, np.full(n - len(creator), -1, creator.dtype)])
    if np.count_nonzero(state) * 4 < n:  # mostly free: histogram only the blocks in use or cached
        used = np.flatnonzero(state)
        ucreator = creator[used]
        nu = max(len(arrays.users), int(ucreator.max()) + 1 if len(used) else 0) + 1  # code + 1 (0: none)
        # cell of block i: the largest k with k*n//cells <= i, i.e. ((i+1)*cells - 1)//n
        key = ((used + 1) * cells - 1) // n
        key *= 2
        key += state[used] - 1  # 0: cached, 1: in use
        key *= nu
        key += ucreator
        key += 1
        table = np.bincount(key, minlength=cells * 2 * nu).reshape(cells, 2, nu)
    else:  # mostly used: one pass over every block, cell ids cached for the shape
        nu = max(len(arrays.users), int(creator.max()) + 1) + 1
        key = state.astype(np.int64) * nu
        key += creator
        key += 1
        key += _cell_keys_base(n, cells, len(STATES) * nu, offsets)
        table = np.bincount(key, minlength=cells * len(STATES) * nu).reshape(cells, len(STATES), nu)[:, 1:, :]
    cached, in_use = table[:, 0, :].sum(axis=1), table[:, 1, :].sum(axis=1)
    free = np.diff(offsets) - cached - in_use
    by_pref = np.stack([in_use, cached, free])  # argmax keeps the first of equals
    dominant = np.array([2, 1, 0], np.int8)[np.argmax(by_pref, axis=0)]
    owners = table[:, :, 1:].sum(axis=1)  # non-free blocks per creator code, per cell
    if owners.shape[1]:
        dom_creator = np.where(owners.sum(axis=1) > 0, np.argmax(owners, axis=1), -1).astype(np.int32)
    else:  # no creator yet (a fresh pool): argmax of nothing would raise
        dom_creator = np.full(cells, -1, np.int32)
    mine = None
    if user is not None:
        code = arrays.users.index(user) if user in arrays.users else -1
        mine = owners[:, code].astype(np.int64) if 0 <= code < owners.shape[1] else np.zeros(cells, np.int64)
    return BlockSummary(arrays.version, start, start + n, offsets + start, free, cached, in_use, dominant,
                        dom_creator, arrays.users, mine)


class Observer:
    """The engine's counters for readers on other threads (views read a mirror of the events)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._stats: dict = {}

    # --- on the engine thread, under its lock ---------------------------------------------------
    def publish(self) -> None:
        """Refresh the published stats (the copy a reader gets while a step holds the lock)."""
        self._stats = self.compute_stats()

    def compute_stats(self) -> dict:
        """O(1): every figure is a counter kept by the pool, the scheduler or the runner."""
        eng = self.engine
        pool, sch, cfg = eng.pool, eng.scheduler, eng.config
        block_bytes = eng.runner.store.block_bytes
        resident, dedicated = pool.num_resident(), pool.num_dedicated()
        return {
            "model": eng.model_name,
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free(),
            "blocks_cached": pool.num_cached(),
            "blocks_in_use": pool.num_in_use(),
            "block_size": pool.block_size,
            "block_bytes": block_bytes,
            "pool_bytes": block_bytes * pool.num_blocks,
            "used_bytes": block_bytes * resident,
            "dedicated_bytes": block_bytes * dedicated,
            "bytes_saved": block_bytes * (dedicated - resident),
            "query_tokens": sch.query_tokens,
            "hit_tokens": sch.hit_tokens,
            "hit_rate": sch.hit_tokens / sch.query_tokens if sch.query_tokens else 0.0,
            "evictions": pool.evictions,
            "preemptions": sch.preemptions,
            "collisions_caught": sch.collisions_caught,
            "requests_finished": sch.finished,
            "running": len(sch.running),
            "waiting": len(sch.waiting),
            "forwards": eng.runner.forwards,
            "isolation": cfg.isolation,
            "eviction": cfg.eviction,
            "deterministic": cfg.deterministic,
            "hash": cfg.hash,
            "verify_on_hit": cfg.verify_on_hit,
        }

    # --- from any thread --------------------------------------------------------------------------
    def stats(self, timeout: float | None = 1.0) -> dict:
        lock = self.engine._lock
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            return dict(self._stats)
        try:
            return self.compute_stats()
        finally:
            lock.release()

    def arrays(self, start: int = 0, stop: int | None = None) -> BlockArrays:
        pool = self.engine.pool
        start, stop, _ = slice(start, stop).indices(pool.num_blocks)
        version = self.engine._batches
        state = pool.state_codes()[start:stop].copy()
        creator = pool.creator_codes()[start:stop].copy()
        return BlockArrays(version, start, state, creator, tuple(pool.users))

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None) -> BlockSummary:
        return summarize(self.arrays(start, stop), cells, user)

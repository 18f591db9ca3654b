"""What readers on other threads see of the engine's pool: block views, deltas, arrays, stats.

Nothing here costs O(pool) per engine step: a step only records which blocks it changed (the
pool's ``dirty`` set) under a new *version* number; views are built when someone asks.

Block map API (all on ``Engine``; safe from any thread):

- ``stats(timeout=1.0) -> dict``: O(1) counters (kept incrementally by the pool and scheduler).
  Waits up to `timeout` s for the current step to end; on timeout returns the copy published
  after the last step. ``stats(timeout=0)`` never waits.
- ``snapshot(timeout=1.0) -> tuple[BlockView, ...]``: every block, as of the last step. Built
  lazily: the first call after a change patches the previous tuple with the changed blocks
  (O(pool) to copy the tuple: fine for small pools, avoid at 10^5+ blocks).
- ``snapshot_changes(since=None, timeout=None) -> (version, list[BlockView]) | None``: the blocks
  whose state changed after version `since` (every block when `since` is None, unknown or too
  old), as of `version`. Keep `version` and pass it back next time. Costs O(changed blocks)
  while the change log reaches back to `since`; older asks scan a per-block version array
  (numpy, ~1 ms at 10^6 blocks). None when the engine stays busy for longer than `timeout` s.
- ``block_arrays(start=0, stop=None) -> BlockArrays``: copies of the per-block state codes
  (int8, index into ``STATES``: free, cached, in_use) and creator codes (int32, index into
  ``users``, -1 none) for blocks [start, stop). Read without the engine lock (never waits; a
  copy taken while a step runs may show part of that step). ~1 ms at 10^6 blocks.
- ``block_summary(cells, start=0, stop=None, user=None) -> BlockSummary``: the range split into
  `cells` equal runs of blocks (``bounds[k]:bounds[k+1]``); per cell the counts of free, cached
  and in-use blocks, the dominant state (ties: in_use > cached > free), the dominant creator
  among non-free blocks (code into ``users``, -1 none) and, with `user`, how many non-free blocks
  that user created. For a whole-pool map at any size ("1 cell = N blocks"), zoom (start/stop),
  and the `/` filter. Lock-free like ``block_arrays``; ~3-15 ms at 10^6 blocks (busy 2-core box).
- ``block_view(engine.pool, block_id) -> BlockView`` (this module): one block's details, read
  without the lock (a view taken mid-step may mix that step's before and after).

Jumping to a request's blocks: the ``BlockHit`` and ``BlockStored`` events carry block ids.
The figures above come from ``python -m kvplay.bench.scale`` (bench/scale.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .pool import STATES, BlockPool

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

LOG_MAX_IDS = 65_536  # change-log entries kept (block ids, summed); a bigger change clears the log


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

    @property
    def blocks_per_cell(self) -> float:
        return (self.stop - self.start) / max(1, self.cells)


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
    """Owns the published picture of one engine's pool (see the module docstring)."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self.version = 0  # bumped by every publish that saw a change
        self._versions: np.ndarray | None = None  # per block: version of its last change
        self._log: deque[tuple[int, list[int]]] = deque()  # (version, changed ids), oldest first
        self._log_ids = 0
        self._covered_from = 0  # the log answers any `since` >= this
        self._full: tuple[BlockView, ...] | None = None
        self._full_version = -1
        self._stats: dict = {}

    # --- on the engine thread, under its lock ---------------------------------------------------
    def publish(self) -> None:
        """Record the blocks changed since the last publish; refresh the published stats."""
        pool = self.engine.pool
        if self._versions is None:
            self._versions = np.zeros(pool.num_blocks, np.int64)  # version 0: every block free
        elif len(self._versions) != pool.num_blocks:  # a new pool: every block changed
            self.version += 1
            self._versions = np.full(pool.num_blocks, self.version, np.int64)
            self._log.clear()
            self._log_ids, self._covered_from, self._full = 0, self.version, None
        dirty = pool.dirty
        if dirty:
            self.version += 1
            ids = list(dirty)
            dirty.clear()
            self._versions[ids] = self.version
            if len(ids) > LOG_MAX_IDS:
                self._log.clear()
                self._log_ids, self._covered_from = 0, self.version
            else:
                self._log.append((self.version, ids))
                self._log_ids += len(ids)
                while self._log_ids > LOG_MAX_IDS:
                    v, old = self._log.popleft()
                    self._log_ids -= len(old)
                    self._covered_from = v
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

    def _changed_ids(self, since: int | None):
        """Ids changed after `since` (under the engine lock); None means every block."""
        v = self.version
        if since is None or since < 0 or since > v or self._versions is None:
            return None
        if since == v:
            return []
        if since >= self._covered_from:
            out: set[int] = set()
            for ver, ids in reversed(self._log):
                if ver <= since:
                    break
                out.update(ids)
            return sorted(out)
        return np.flatnonzero(self._versions > since).tolist()

    def changes(self, since: int | None = None, timeout: float | None = None):
        lock = self.engine._lock
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            return None
        try:
            pool = self.engine.pool
            ids = self._changed_ids(since)
            if ids is None:
                ids = range(pool.num_blocks)
            return self.version, [block_view(pool, b) for b in ids]
        finally:
            lock.release()

    def snapshot(self, timeout: float | None = 1.0) -> tuple[BlockView, ...]:
        lock = self.engine._lock
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            if self._full is not None:
                return self._full  # busy: the last one built
            lock.acquire()
        try:
            if self._full is None or self._full_version != self.version:
                pool = self.engine.pool
                ids = self._changed_ids(self._full_version if self._full is not None else None)
                if ids is None:
                    full = tuple(block_view(pool, b) for b in range(pool.num_blocks))
                else:
                    lst = list(self._full)
                    for b in ids:
                        lst[b] = block_view(pool, b)
                    full = tuple(lst)
                self._full, self._full_version = full, self.version
            return self._full
        finally:
            lock.release()

    def arrays(self, start: int = 0, stop: int | None = None) -> BlockArrays:
        pool = self.engine.pool
        start, stop, _ = slice(start, stop).indices(pool.num_blocks)
        version = self.version
        state = pool.state_codes()[start:stop].copy()
        creator = pool.creator_codes()[start:stop].copy()
        return BlockArrays(version, start, state, creator, tuple(pool.users))

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None) -> BlockSummary:
        return summarize(self.arrays(start, stop), cells, user)

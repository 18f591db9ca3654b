"""The engine's counters: ``Engine.stats(timeout=1.0) -> dict``, O(1) (kept incrementally by the
pool, the scheduler and the runner), for the CLI, the server's /metrics and the bench. Waits up to
`timeout` s for the current step to end; on timeout returns the copy published after the last
step. Views (the block map, stats, scrubber, attach) read a mirror of the engine's events
(wire/mirror.Mirror), never the engine's pool.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine


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

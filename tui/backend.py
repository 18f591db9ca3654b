"""The app's default ChatBackend: an in-process Engine (the interface and its Controls are
kvplay.wire.chat_backend; `kvplay attach`'s is kvplay.wire.remote.RemoteBackend).

The pool the views read is a `Mirror` fed by the engine's event batches, read in ranges
(`summary`, `arrays`, `block`), never as one object per block, so a 1M-block pool costs what the
visible cells cost. No Textual here: a backend is usable (and testable) without the app.
"""
from __future__ import annotations

import threading
from typing import Callable

from kvplay.wire.views import summarize
from kvplay.wire.chat_backend import ChatBackend, Controls, Turn
from kvplay.wire.mirror import Mirror
from kvplay.wire.miss_watch import PodMisses

# an in-process engine: every setting is the app's to change
LOCAL_CONTROLS = Controls(isolation=True, eviction=True, deterministic=True, clear=True, groups=True, labs=True)


class LocalEngineBackend(ChatBackend):
    """A ChatBackend over an in-process Engine (the app's default). The pool the views read is a
    `Mirror` fed by the engine's event batches (`subscribe_batches`): nothing here reads the
    engine's pool, observer or stats; the engine object needs only `register_user`, `submit`,
    `subscribe_batches`, `num_blocks`, `block_bytes`, `config` (the settings shown), `tokenizer`
    and `shutdown`."""

    controls = LOCAL_CONTROLS

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.device = str(getattr(getattr(engine, "loaded", None), "device", ""))
        self.mirror = Mirror(engine.num_blocks)
        self._block_bytes = engine.block_bytes
        self._lock = threading.Lock()  # batches apply on the engine thread; views read from others
        self.misses = PodMisses(self.mirror)  # the prefix tree's marks (branches, recomputed chains)
        self._unsub = engine.subscribe_batches(self._on_batch)

    def _on_batch(self, batch) -> None:
        with self._lock:
            self.mirror.apply(batch)
            self.misses.apply(batch)

    def register_user(self, name: str, group: str | None = None) -> None:
        self.engine.register_user(name, group)

    def submit(self, user: str, messages: list[dict], sampling=None) -> Turn:
        return self.engine.submit(user, messages, sampling)

    def subscribe_batches(self, fn: Callable) -> Callable[[], None]:
        return self.engine.subscribe_batches(fn)

    @property
    def version(self) -> int:
        return self.mirror.version

    def stats(self, timeout: float = 0.0) -> dict | None:
        cfg = self.engine.config
        with self._lock:
            s = self.mirror.stats()
        bb = self._block_bytes
        s.update(model=self.model_name, block_size=cfg.block_size, block_bytes=bb,
                 pool_bytes=bb * s["blocks_total"], used_bytes=bb * s["blocks_resident"],
                 dedicated_bytes=bb * s["blocks_dedicated"],
                 bytes_saved=bb * (s["blocks_dedicated"] - s["blocks_resident"]),
                 isolation=cfg.isolation, eviction=cfg.eviction, deterministic=cfg.deterministic,
                 hash=cfg.hash, verify_on_hit=cfg.verify_on_hit)
        return s

    @property
    def num_blocks(self) -> int:
        return self.mirror.num_blocks

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        with self._lock:  # the copies only; the histogram runs after
            arrays, total = self.mirror.used_arrays(start, stop)
        return summarize(arrays, cells, user, total=total)

    def arrays(self, start: int = 0, stop: int | None = None):
        with self._lock:
            return self.mirror.arrays(start, stop)

    def block(self, block_id: int):
        with self._lock:
            return self.mirror.block(block_id)

    def decode(self, token_ids) -> str:
        return self.engine.tokenizer.decode(list(token_ids))

    def close(self, timeout: float = 1.0) -> None:
        self._unsub()
        self.engine.shutdown(timeout=timeout)

    # --- controls: through the engine's queue, so each is an event where it happened ------------
    def reconfigure(self, **changes) -> None:
        self.engine.reconfigure(**changes)

    def fresh_cache_blocks(self, **changes) -> int:
        return self.stats()["blocks_cached"] if self.engine.needs_fresh_cache(**changes) else 0

    def setting(self, name: str):
        return getattr(self.engine.config, name)

    def clear_cache(self) -> int | None:
        return self.engine.clear_cache()

    def set_group(self, user: str, group: str | None) -> None:
        self.engine.set_group(user, group)

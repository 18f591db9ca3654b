"""What the app talks to: one chat interface and one picture of the pool, whatever serves them.

`ChatBackend` is the interface the panes and the block map use: submit a user's turn, stream
its text, get its result (with `stats.cached_from`); subscribe to the engine's events; read
counters; and read the pool in ranges (`summary`, `arrays`, `block`), never as one object per
block, so a 1M-block pool costs what the visible cells cost. `LocalEngineBackend` wraps an
in-process `Engine`; a remote backend (`kvplay attach`) implements the same methods over HTTP
and KV events. No Textual here: a backend is usable (and testable) without the app.
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator, Protocol

from kvplay.engine.observe import summarize
from kvplay.wire.slots import SlotMirror


class Turn(Protocol):
    """One submitted turn: iterate for deltas (each with `.text`), then `result()`."""

    request_id: str

    def __iter__(self) -> Iterator: ...

    def result(self, timeout: float | None = None): ...


class ChatBackend:
    """The interface (a local engine implements it below; a remote server implements it too)."""

    model_name: str = ""
    device: str = ""

    # --- chat ---------------------------------------------------------------------------------
    def register_user(self, name: str, group: str | None = None) -> None:
        raise NotImplementedError

    def submit(self, user: str, messages: list[dict], sampling=None) -> Turn:
        """Queue `user`'s turn (identity and group come from the backend, not the request)."""
        raise NotImplementedError

    # --- observation --------------------------------------------------------------------------
    def subscribe(self, listener: Callable) -> Callable[[], None]:
        """Call `listener(event)` for every event (on the backend's thread); returns an unsubscribe."""
        raise NotImplementedError

    def stats(self, timeout: float = 0.0) -> dict | None:
        raise NotImplementedError

    @property
    def num_blocks(self) -> int:
        raise NotImplementedError

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        """The blocks [start, stop) in `cells` equal runs (kvplay.engine.observe.BlockSummary)."""
        raise NotImplementedError

    def arrays(self, start: int = 0, stop: int | None = None):
        """State and creator codes of the blocks [start, stop) (kvplay.engine.observe.BlockArrays)."""
        raise NotImplementedError

    def block(self, block_id: int):
        """One block's details (kvplay.engine.observe.BlockView), or None."""
        raise NotImplementedError

    def decode(self, token_ids) -> str:
        raise NotImplementedError

    def close(self, timeout: float = 1.0) -> None:
        raise NotImplementedError


class LocalEngineBackend(ChatBackend):
    """A ChatBackend over an in-process Engine (the app's default). The pool the views read is a
    `SlotMirror` fed by the engine's event batches (`subscribe_batches`): nothing here reads the
    engine's pool, observer or stats; the engine object needs only `register_user`, `submit`,
    `subscribe`, `subscribe_batches`, `num_blocks`, `block_bytes`, `config` (the settings shown),
    `tokenizer` and `shutdown`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.device = str(getattr(getattr(engine, "loaded", None), "device", ""))
        self.mirror = SlotMirror(engine.num_blocks)
        self._block_bytes = engine.block_bytes
        self._lock = threading.Lock()  # batches apply on the engine thread; views read from others
        self._unsub = engine.subscribe_batches(self._on_batch)

    def _on_batch(self, batch) -> None:
        with self._lock:
            self.mirror.apply_batch(batch)

    def register_user(self, name: str, group: str | None = None) -> None:
        self.engine.register_user(name, group)

    def submit(self, user: str, messages: list[dict], sampling=None) -> Turn:
        return self.engine.submit(user, messages, sampling)

    def subscribe(self, listener: Callable) -> Callable[[], None]:
        return self.engine.subscribe(listener)

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

"""What the app talks to: one chat interface and one picture of the pool, whatever serves them.

`ChatBackend` is the interface the panes and the block map use: submit a user's turn, stream
its text, get its result (with `stats.cached_from`); subscribe to the engine's events; read
counters; and read the pool in ranges (`summary`, `arrays`, `block`), never as one object per
block, so a 1M-block pool costs what the visible cells cost. `LocalEngineBackend` wraps an
in-process `Engine`; a remote backend (`kvplay attach`) implements the same methods over HTTP
and KV events. No Textual here: a backend is usable (and testable) without the app.
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol


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
    """A ChatBackend over an in-process Engine (the app's default)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.device = str(getattr(engine.loaded, "device", ""))

    def register_user(self, name: str, group: str | None = None) -> None:
        self.engine.register_user(name, group)

    def submit(self, user: str, messages: list[dict], sampling=None) -> Turn:
        return self.engine.submit(user, messages, sampling)

    def subscribe(self, listener: Callable) -> Callable[[], None]:
        return self.engine.subscribe(listener)

    def stats(self, timeout: float = 0.0) -> dict | None:
        return self.engine.stats(timeout=timeout)

    @property
    def num_blocks(self) -> int:
        return self.engine.pool.num_blocks

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        return self.engine.block_summary(cells, start, stop, user)

    def arrays(self, start: int = 0, stop: int | None = None):
        return self.engine.block_arrays(start, stop)

    def block(self, block_id: int):
        # start-up time: imported when this first runs
        from kvplay.engine.observe import block_view

        if not 0 <= block_id < self.num_blocks:
            return None
        for _ in range(3):  # read without the engine's lock: a step may change the block meanwhile
            try:
                return block_view(self.engine.pool, block_id)
            except RuntimeError:
                continue
        return None

    def decode(self, token_ids) -> str:
        return self.engine.tokenizer.decode(list(token_ids))

    def close(self, timeout: float = 1.0) -> None:
        self.engine.shutdown(timeout=timeout)

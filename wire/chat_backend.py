"""What a chat client talks to, whatever serves it: the `ChatBackend` ABC and its `Controls`.

The app's panes register users, submit turns and stream replies through a `ChatBackend`; its
cache views read the backend's mirror of the pool (in ranges, never one object per block). Two
implement it: an in-process engine (`kvplay.tui.backend.LocalEngineBackend`) and a remote
OpenAI-compatible server with KV events (`kvplay.wire.remote.RemoteBackend`, `kvplay attach`).

`Controls` says which of the engine's settings a backend lets a client change (isolation,
eviction, deterministic mode, clear, a user's group, labs on its engine). The app asks it before
each control, so what a backend does not support is one notice (`Controls.refusal`), never an
overridden action or a traceback. No Textual here: usable and testable without the app.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from kvplay.engine.errors import EngineError

CONTROLS = ("isolation", "eviction", "deterministic", "clear", "groups", "labs")


@dataclass(frozen=True)
class Controls:
    """What a client may change on this backend; `why[name]`: the one line an unsupported
    control answers with (how to change it where it is decided)."""

    isolation: bool = False  # who may share blocks (F2)
    eviction: bool = False  # the eviction policy (F3)
    deterministic: bool = False  # deterministic mode (F5)
    clear: bool = False  # empty the cache (F4)
    groups: bool = False  # move a user to another group (F7), bound in the backend's registry
    labs: bool = False  # run kvplay's labs on this backend's engine (palette)
    why: dict[str, str] = field(default_factory=dict)

    def supports(self, name: str) -> bool:
        if name not in CONTROLS:
            raise KeyError(f"unknown control {name!r} (known: {', '.join(CONTROLS)})")
        return bool(getattr(self, name))

    def refusal(self, name: str) -> str:
        return self.why.get(name) or f"This backend does not support changing {name}."


class Turn(Protocol):
    """One submitted turn: iterate for deltas (each with `.text`), then `result()`."""

    request_id: str

    def __iter__(self) -> Iterator: ...

    def result(self, timeout: float | None = None): ...


class ChatBackend(ABC):
    """Register users, submit their turns, stream and decode; observe the pool; close."""

    model_name: str = ""
    device: str = ""
    controls: Controls = Controls()

    # --- chat ---------------------------------------------------------------------------------
    @abstractmethod
    def register_user(self, name: str, group: str | None = None) -> None:
        """Bind `name` (and its group) in the backend: identity is never taken from a turn."""

    @abstractmethod
    def submit(self, user: str, messages: list[dict], sampling=None) -> Turn:
        """Queue `user`'s turn; iterate the returned Turn for its text as it streams."""

    @abstractmethod
    def decode(self, token_ids) -> str:
        """The text of token ids ("" when the backend cannot say)."""

    @abstractmethod
    def close(self, timeout: float = 1.0) -> None:
        """Stop: turns still running end with an error, so nobody waiting on one hangs."""

    # --- observation --------------------------------------------------------------------------
    @abstractmethod
    def subscribe_batches(self, fn: Callable) -> Callable[[], None]:
        """Call `fn(batch)` with every EngineBatch of events (engine/events.py), on the backend's
        thread; returns an unsubscribe."""

    @abstractmethod
    def stats(self, timeout: float = 0.0) -> dict | None:
        """Counters and settings as the stats panel shows them."""

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def version(self) -> int:
        """Moves whenever the mirrored pool changes (the map redraws on it)."""

    @abstractmethod
    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        """The blocks [start, stop) in `cells` equal runs (kvplay.wire.views.BlockSummary)."""

    @abstractmethod
    def arrays(self, start: int = 0, stop: int | None = None):
        """State and creator codes of the blocks [start, stop) (kvplay.wire.views.BlockArrays)."""

    @abstractmethod
    def block(self, block_id: int):
        """One block's details (kvplay.wire.views.BlockView), or None."""

    # --- controls (what `controls` says this backend supports) ---------------------------------
    def _refuse(self, name: str):
        raise EngineError(self.controls.refusal(name))

    def reconfigure(self, **changes) -> None:
        """Change isolation / eviction / deterministic mode (EngineConfig names)."""
        self._refuse(next(iter(changes), "isolation"))

    def fresh_cache_blocks(self, **changes) -> int:
        """How many cached blocks `reconfigure(**changes)` would drop (0: none)."""
        return 0

    def setting(self, name: str):
        """The current value of an EngineConfig setting (isolation, eviction, deterministic)."""
        return None

    def clear_cache(self) -> int | None:
        """Empty the cache: the blocks dropped, or None when the backend cannot say."""
        self._refuse("clear")

    def set_group(self, user: str, group: str | None) -> None:
        self._refuse("groups")

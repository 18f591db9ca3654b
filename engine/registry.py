"""Who is asking: the engine's user registry (name -> group).

Identity is bound where it is authenticated, never taken from a request: the app registers
each pane's user, ``kvplay run`` each script ``[[users]]`` entry, ``kvplay serve`` each API
key. ``submit`` carries only the user name; the group comes from here. Changing a group is an
explicit engine action (``Engine.set_group``, recorded as a ``UserGroupChanged`` event) and
applies to requests submitted afterwards only: a request's group is read when the engine
thread takes the request in.

The salt a request's blocks carry is derived from (isolation mode, user, group) by
``prefix.salt_for``: user and group salts are typed by kind, so a group that borrows a user's
name never shares that user's blocks.
"""
from __future__ import annotations

import threading

from .errors import EngineError


def check_name(what: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise EngineError(f"a {what} name must be a non-empty string (got {value!r})")
    return value


def check_user(name, group=None) -> None:
    """A user name, and a group name unless None: non-empty strings (else one EngineError line)."""
    check_name("user", name)
    if group is not None:
        check_name("group", group)


class UserRegistry:
    """Thread-safe name -> group map. Unknown users are registered with group None on first use."""

    def __init__(self):
        self._groups: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def register(self, name: str, group: str | None = None) -> bool:
        """Bind `name` to `group`. Returns True when the user is new; registering again with the
        same group is a no-op; a different group is an error (use ``set_group``)."""
        check_user(name, group)
        with self._lock:
            if name in self._groups:
                old = self._groups[name]
                if old != group:
                    raise EngineError(f"user {name!r} is already registered in group {old or '-'}; "
                                      f"changing it to {group or '-'} needs set_group")
                return False
            self._groups[name] = group
            return True

    def set_group(self, name: str, group: str | None) -> str | None:
        """Change (or set) `name`'s group; returns the old group."""
        check_user(name, group)
        with self._lock:
            old = self._groups.get(name)
            self._groups[name] = group
            return old

    def group_of(self, name: str) -> str | None:
        """`name`'s group, registering the user (group None) if unknown."""
        with self._lock:
            return self._groups.setdefault(name, None)

    def users(self) -> dict[str, str | None]:
        with self._lock:
            return dict(self._groups)

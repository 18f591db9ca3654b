"""API keys -> identities: the only place `kvplay serve` learns who is asking.

    [[keys]]
    key = "sk-alice-…"
    user = "alice"
    group = "team-a"     # optional
    admin = true         # optional: may POST /reset_prefix_cache (wipes every user's cache)

Each bearer token is bound to one user (and group); the server registers every user with the
engine at start, so the salt of a request comes from its key, never from its body. A user or group
name is a name people read (start-up line, KV events' session_id, /metrics, recordings): one with
a control, bidi or invisible character (kvplay/inert.py) is refused with one line.
"""
from __future__ import annotations

import hmac
import tomllib
from dataclasses import dataclass

from kvplay.engine.errors import EngineError
from kvplay.inert import hidden, inert


@dataclass(frozen=True)
class Identity:
    user: str
    group: str | None = None
    admin: bool = False  # may reset the whole prefix cache (everyone's blocks)


def load_keys(path: str) -> dict[str, Identity]:
    """Read an --api-keys TOML file; every problem is one EngineError line."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise EngineError(f"--api-keys {path}: no such file") from None
    except OSError as exc:
        raise EngineError(f"--api-keys {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise EngineError(f"--api-keys {path}: not valid TOML ({exc})") from None
    entries = data.get("keys")
    unknown = set(data) - {"keys"}
    if unknown:
        raise EngineError(f"--api-keys {path}: unknown table {sorted(unknown)[0]!r} (only [[keys]])")
    if not isinstance(entries, list) or not entries:
        raise EngineError(f'--api-keys {path}: needs at least one [[keys]] entry with key = "…" and user = "…"')
    out: dict[str, Identity] = {}
    users: dict[str, str | None] = {}
    for i, e in enumerate(entries, 1):
        where = f"--api-keys {path}: [[keys]] #{i}"
        if not isinstance(e, dict):
            raise EngineError(f"{where}: must be a table")
        extra = set(e) - {"key", "user", "group", "admin"}
        if extra:
            raise EngineError(f"{where}: unknown field {sorted(extra)[0]!r} (key, user, group, admin)")
        key, user, group, admin = e.get("key"), e.get("user"), e.get("group"), e.get("admin", False)
        if not isinstance(key, str) or len(key.strip()) < 8 or key != key.strip():
            raise EngineError(f"{where}: key must be a string of at least 8 characters without spaces around it")
        if not isinstance(user, str) or not user.strip():
            raise EngineError(f"{where}: user must be a non-empty string")
        if group is not None and (not isinstance(group, str) or not group.strip()):
            raise EngineError(f"{where}: group must be a non-empty string when given")
        for what, name in (("user", user), ("group", group)):
            bad = hidden(name) if name is not None else None
            if bad is not None:
                raise EngineError(f"{where}: {what} {inert(name, limit=64)!r} has a control or invisible character "
                                  f"({bad}): give a name people can read")
        if not isinstance(admin, bool):
            raise EngineError(f"{where}: admin must be true or false")
        if key in out:
            raise EngineError(f"{where}: the same key is listed twice")
        if user in users and users[user] != group:
            raise EngineError(f"{where}: user {user!r} is listed with two different groups")
        users[user] = group
        out[key] = Identity(user, group, admin)
    return out


def lookup(keys: dict[str, Identity], authorization: str | None) -> Identity | None:
    """The identity of an `Authorization: Bearer KEY` header, or None (compared in constant time)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    token = token.strip().encode()
    found = None
    for key, ident in keys.items():
        if hmac.compare_digest(key.encode(), token):
            found = ident
    return found

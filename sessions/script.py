"""Scripts: the TOML format shared by `kvplay run`, `kvplay screenshot --script`, replay and
`kvplay export --format toml`.

```toml
[engine]                 # any EngineConfig field (command-line flags override it)
isolation = "shared"
cache_mb = 64

[system]
prompt = "You are a helpful assistant."

[[users]]
name = "alice"
group = "team-a"         # optional (isolation = "group")
seed = 1                 # optional, default: derived from the name
temperature = 0.0        # optional, default 0 (greedy)
max_tokens = 48          # optional

[[turns]]
user = "alice"
text = "What is a KV cache?"
max_tokens = 32          # optional: temperature, seed, top_p, top_k too
at = 0.0                 # optional: seconds from start; turns with `at` run concurrently
group = "team-b"         # optional: the user's group from this turn on ("" = none), applied by
                         # the engine's registry right before the turn (recorded as a change)
clear = true             # optional: empty the cache right before this turn (the app's F4)
engine = { isolation = "user", deterministic = true }
                         # optional: settings changed right before this turn (after `clear`), as
                         # the app's F2/F3/F5 do: any [engine] field a running engine can change
```
A recorded session exports (`kvplay export ID --format toml`) its starting settings as [engine]
and every later change (settings, clear, group) on the turn queued right after it. Its strings
are TOML basic strings in which every character kvplay/inert.py calls hidden (ESC, NUL, bidi
overrides …) is a `\\uXXXX` escape: the file is valid TOML, inert to look at, and parses back to
the recorded text byte for byte.

Turns of one user form that user's conversation: a later turn includes the earlier turns and
their replies. A user's group matters only to that user's own requests (it salts their block
hashes), so a group change recorded anywhere in a session is written on the user's next turn.
"""
from __future__ import annotations

import dataclasses
import tomllib
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from kvplay.engine.config import RESTART_FIELDS, EngineConfig
from kvplay.engine.errors import EngineError
from kvplay.engine.sampling_params import SamplingParams
from kvplay.inert import inert

DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly and plainly."
TURN_KEYS = {"user", "text", "max_tokens", "temperature", "seed", "top_p", "top_k", "at", "group", "clear",
             "engine"}
USER_KEYS = {"name", "group", "seed", "temperature", "max_tokens", "top_p", "top_k", "colour", "color"}


class ScriptError(EngineError):
    """A script that cannot be run: malformed TOML (with its line), unknown user, bad field."""


def sampling_for(user: "UserSpec", turn: "TurnSpec | None" = None):
    """A turn's sampling: the user's settings, each overridden by the turn's when it sets one."""
    def pick(name):
        value = getattr(turn, name) if turn is not None else None
        return getattr(user, name) if value is None else value

    return SamplingParams(temperature=float(pick("temperature")), top_p=float(pick("top_p")),
                          top_k=int(pick("top_k")), max_tokens=int(pick("max_tokens")),
                          seed=pick("seed")).validate()


def default_seed(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@dataclass
class UserSpec:
    name: str
    group: str | None = None
    seed: int | None = None
    temperature: float = 0.0
    max_tokens: int = 48
    top_p: float = 1.0
    top_k: int = 0
    colour: str | None = None

    def __post_init__(self):
        if self.seed is None:
            self.seed = default_seed(self.name)


@dataclass
class TurnSpec:
    user: str
    text: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    at: float | None = None
    group: str | None = None  # the user's group from this turn on ("" = none); None: unchanged
    clear: bool | None = None  # empty the cache before this turn
    engine: dict | None = None  # settings changed before this turn (after `clear`)


@dataclass
class Script:
    engine: dict = field(default_factory=dict)
    system: str = DEFAULT_SYSTEM
    users: list[UserSpec] = field(default_factory=list)
    turns: list[TurnSpec] = field(default_factory=list)
    path: str | None = None

    def user(self, name: str) -> UserSpec:
        for u in self.users:
            if u.name == name:
                return u
        raise ScriptError(f"unknown user {name!r}")


def _check_keys(table: dict, allowed: set, where: str) -> None:
    extra = set(table) - allowed
    if extra:
        raise ScriptError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")


FIELD_TYPES = {  # TOML value types each field accepts (ints are fine where floats are)
    "name": (str,), "user": (str,), "text": (str,), "group": (str,), "colour": (str,),
    "seed": (int,), "max_tokens": (int,), "top_k": (int,),
    "temperature": (int, float), "top_p": (int, float), "at": (int, float), "clear": (bool,),
    "engine": (dict,),
}


def _check_types(table: dict, where: str) -> None:
    for key, value in table.items():
        want = FIELD_TYPES.get("colour" if key == "color" else key)
        if want and ((isinstance(value, bool) and bool not in want) or not isinstance(value, want)):
            kind = {(str,): "a string", (int,): "an integer", (bool,): "true or false",
                    (dict,): "a table"}.get(want, "a number")
            raise ScriptError(f"{where}: `{key}` must be {kind}, got {value!r}")
    for key in ("max_tokens", "top_k", "temperature", "at"):
        if key in table and not isinstance(table[key], bool) and isinstance(table[key], (int, float)) \
                and table[key] < 0:
            raise ScriptError(f"{where}: `{key}` must not be negative, got {table[key]!r}")


def _check_settings(changes: dict, where: str) -> None:
    """A turn's `engine` table: fields a running engine can change, with valid values."""
    if not changes:
        raise ScriptError(f"{where}: empty table")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    for key, value in changes.items():
        if key not in names:
            raise ScriptError(f"{where}: unknown engine option {key!r}")
        if key in RESTART_FIELDS:
            raise ScriptError(f"{where}: {key} cannot change while the engine runs (set it in [engine])")
        if value is None or isinstance(value, (dict, list)):
            raise ScriptError(f"{where}: `{key}` has a bad value {value!r}")
    try:
        EngineConfig().replace(**changes).validate()
    except EngineError as exc:
        raise ScriptError(f"{where}: {exc}") from None


def _tables(data: dict, key: str, where: str) -> list[dict]:
    items = data.get(key, [])
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise ScriptError(f"{where}: `{key}` must be an array of tables ([[{key}]])")
    return items


def parse_script(text: str, where: str = "script") -> Script:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScriptError(f"{where}: malformed TOML: {exc}") from None
    _check_keys(data, {"engine", "system", "users", "turns"}, where)
    engine = data.get("engine", {})
    if not isinstance(engine, dict):
        raise ScriptError(f"{where}: [engine] must be a table")
    system = data.get("system", {})
    if isinstance(system, str):
        prompt = system
    elif isinstance(system, dict):
        _check_keys(system, {"prompt"}, f"{where}: [system]")
        prompt = system.get("prompt", DEFAULT_SYSTEM)
        if not isinstance(prompt, str):
            raise ScriptError(f"{where}: [system] prompt must be a string")
    else:
        raise ScriptError(f"{where}: [system] must be a table with `prompt`")
    users = []
    for i, u in enumerate(_tables(data, "users", where)):
        _check_keys(u, USER_KEYS, f"{where}: users[{i}]")
        _check_types(u, f"{where}: users[{i}]")
        if "name" not in u or not str(u["name"]).strip():
            raise ScriptError(f"{where}: users[{i}] needs a name")
        u = dict(u)
        if "color" in u:
            u["colour"] = u.pop("color")
        users.append(UserSpec(**u))
    names = [u.name for u in users]
    if len(set(names)) != len(names):
        raise ScriptError(f"{where}: duplicate user names")
    turns = []
    for i, t in enumerate(_tables(data, "turns", where)):
        _check_keys(t, TURN_KEYS, f"{where}: turns[{i}]")
        _check_types(t, f"{where}: turns[{i}]")
        if "user" not in t or "text" not in t:
            raise ScriptError(f"{where}: turns[{i}] needs `user` and `text`")
        if t["user"] not in names:
            if users:
                raise ScriptError(f"{where}: turns[{i}]: unknown user {t['user']!r} (users: {', '.join(names)})")
            users.append(UserSpec(t["user"]))  # no [[users]] table: users are implied by turns
            names.append(t["user"])
        if not str(t["text"]).strip():
            raise ScriptError(f"{where}: turns[{i}]: empty message")
        if "engine" in t:
            _check_settings(t["engine"], f"{where}: turns[{i}].engine")
        turns.append(TurnSpec(**t))
    if not turns:
        raise ScriptError(f"{where}: no [[turns]]")
    return Script(engine=engine, system=prompt, users=users, turns=turns)


def load_script(path: str | Path) -> Script:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScriptError(f"script not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError(f"cannot read script {p}: {exc}") from None
    script = parse_script(text, str(p))
    script.path = str(p)
    return script


def _toml_escape(ch: str) -> str:
    o = ord(ch)
    if 0xD800 <= o <= 0xDFFF:  # a lone surrogate has no UTF-8 and no TOML escape
        return "\\uFFFD"
    return f"\\u{o:04X}" if o < 0x10000 else f"\\U{o:08X}"


def _toml_str(s: str, lines: bool) -> str:
    """`s` for a TOML basic string: backslashes escaped, then every hidden character (a multi-line
    string keeps LF and TAB) as \\uXXXX."""
    return inert(s.replace("\\", "\\\\"), lines=lines, limit=None, show=_toml_escape)


def _toml_value(v) -> str:
    if isinstance(v, dict):  # an inline table (a turn's `engine`)
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    if "\n" in s:
        return '"""\n' + _toml_str(s, True).replace('"""', '\\"\\"\\"') + '"""'
    return '"' + _toml_str(s, False).replace('"', '\\"') + '"'


def dump_script(script: Script) -> str:
    """Serialise a Script back to TOML (used by `kvplay export --format toml`)."""
    out = []
    if script.engine:
        out.append("[engine]")
        out += [f"{k} = {_toml_value(v)}" for k, v in script.engine.items() if v is not None]
        out.append("")
    out += ["[system]", f"prompt = {_toml_value(script.system)}", ""]
    user_keys = ("name", "group", "seed", "temperature", "max_tokens", "top_p", "top_k", "colour")
    turn_keys = ("user", "text", "max_tokens", "temperature", "seed", "top_p", "top_k", "at", "group", "clear",
                 "engine")
    for header, items, keys in (("[[users]]", script.users, user_keys), ("[[turns]]", script.turns, turn_keys)):
        for item in items:
            out.append(header)
            out += [f"{k} = {_toml_value(getattr(item, k))}" for k in keys if getattr(item, k) is not None]
            out.append("")
    return "\n".join(out)

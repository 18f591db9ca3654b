"""Formatting shared by `kvplay run`, `replay`, `show` and `export`: per-turn rows, JSON objects, times.

What a row quotes (a user's text, a reply, a name) is inert (kvplay/inert.py); the tables that
parse markup take it through `markup()` or as `Text`."""
from __future__ import annotations

import datetime as dt
import sys
from typing import Any

from rich.console import Console

from kvplay.engine.miss import miss_text
from kvplay.inert import inert, json_dumps

from .player import Done


def attribution(cached_from: dict[str, int] | None, user: str) -> str:
    """{"alice": 496, "bob": 16} seen by bob -> "alice 496, own 16" (the names inert)."""
    if not cached_from:
        return ""
    items = sorted(cached_from.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{'own' if who == user else inert(who, limit=64)} {n}" for who, n in items if n)


def cached_cell(cached: int | None, prompt: int | None, cached_from: dict[str, int] | None, user: str) -> str:
    """Cached tokens and whose blocks they were: "512 (alice 496, own 16)", with the prompt's
    length "32/34 (alice 32)"; "-" when unknown."""
    if cached is None:
        return "-"
    who = attribution(cached_from, user)
    return f"{cached}" + ("" if prompt is None else f"/{prompt}") + (f" ({who})" if who else "")


def computed_cell(computed: int | None, miss: dict | None, user: str | None = None) -> str:
    """Computed prompt tokens and why: "42: 26 diverged at 497, 16 tail", "10 (tail)"; the bare
    count when the turn has no miss object (recorded before kvplay explained misses)."""
    if computed is None:
        return "-"
    return miss_text(miss, user) or str(computed)


def excerpt(text: str, width: int = 60) -> str:
    """`text` on one line, at most `width` characters of it, inert."""
    flat = " ".join((text or "").split())
    return inert(flat) if len(flat) <= width else inert(flat[: width - 1]) + "…"


def turn_object(done: Done) -> dict:
    res, st = done.result, done.result.stats if done.result else None
    return {
        "turn": done.job.turn, "user": done.job.user, "text": done.job.text,
        "prompt_tokens": st.prompt_tokens if st else None,
        "cached_tokens": st.cached_tokens if st else None,
        "cached_from": dict(st.cached_from) if st else {},
        "computed_tokens": st.computed_tokens if st else None,
        "miss": st.miss if st else None,
        "ttft_ms": None if not st or st.ttft_ms is None else round(st.ttft_ms, 2),
        "output_tokens": st.output_tokens if st else None,
        "decode_tok_s": None if not st or st.decode_tok_s is None else round(st.decode_tok_s, 2),
        "preemptions": st.preemptions if st else None,
        "reply": res.text if res else None,
        "finish_reason": res.finish_reason if res else "error",
        "error": done.error,
        "seed": st.seed if st and st.seed is not None else done.job.sampling.seed,
        "at": done.job.at,
    }


def print_json(obj: dict, file=None) -> None:
    print(json_dumps(obj), file=file or sys.stdout, flush=True)


# The number formatting of every text view (run/show/replay tables, lab tables, bench tables,
# the app's stats). Textual-free, so tui/, labs/ and bench/ import it from here. The placeholder
# for a missing value differs by view (kept as each view printed it): "-" in session tables,
# "—" in lab tables, "–" in bench tables and the app.

def fmt(v: Any, spec: str | None = None, none: str = "—") -> str:
    """Short, readable text for one value (a table cell), never a Python repr: `none` for None,
    yes/no for a bool; with `spec` (a format spec: ".1f", "d", ".0%") the value formatted by it;
    else mappings read "alice 32, bob 16", lists "a, b", floats keep about three digits."""
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "no"
    if spec is not None:
        return format(v, spec)
    if isinstance(v, dict):
        return ", ".join(f"{k} {fmt(x)}" for k, x in v.items()) or "—"
    if isinstance(v, (list, tuple, set, frozenset)):
        return ", ".join(fmt(x) for x in v) or "—"
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1000 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def fmt_num(v, digits: int = 1) -> str:
    """A session table's number: floats with `digits` decimals, ints as they are, "-" for None."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def mib(n: float | None, unit: bool = True, none: str = "–") -> str:
    """Bytes as MiB with one decimal: "12.5 MiB" (unit=False: "12.5", for a column named MiB)."""
    if n is None:
        return none
    return f"{n / 1024 / 1024:.1f}" + (" MiB" if unit else "")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def console(stderr: bool = False, width: int = 120):
    """A rich Console; `width` columns when not a terminal so piped tables stay readable."""
    stream = sys.stderr if stderr else sys.stdout
    con = Console(file=stream)
    return con if con.is_terminal else Console(file=stream, width=width)


def when(ts: float | None) -> str:
    """A recorded timestamp, local time to the second ('-' for none)."""
    return "-" if ts is None else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")

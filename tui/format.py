"""Plain formatting of engine numbers as Rich Text: the reply badge, request bars, sparklines,
the stats block. No widgets here, so these are easy to test and reuse. Names, the model and a
block's text are inert (kvplay/inert.py): a server's session ids and decoded tokens among them."""
from __future__ import annotations

import time

import numpy as np
from rich.style import Style
from rich.text import Text

from kvplay.engine.miss import miss_from_event, miss_text
from kvplay.inert import inert
from kvplay.sessions.report import mib

from .theme import FREE_STYLE, UNKNOWN_COLOUR, UserLook

SPARK = "▁▂▃▄▅▆▇█"
DIM = Style(color="#8a8a8a")


def _look(looks: dict[str, UserLook], name: str) -> UserLook:
    return looks.get(name) or UserLook(name, UNKNOWN_COLOUR, "?")


def badge(stats, looks: dict[str, UserLook], timings: bool = True) -> Text:
    """`prompt 532 · cached 512 (alice 496, own 16) · missed 20: 4 diverged at 513, 16 tail ·
    TTFT 0.14 s · 18 tok/s` (`missed 4 (tail)` when only the last block was computed; why: see
    engine/miss.py); attached, also `as predicted` or `predicted 480 ≠` (the mirror's prefix
    match before sending vs the usage), or `salted: no prediction` (the server's salt decides
    and is not known yet)."""
    t = Text(style=DIM)
    t.append(f"prompt {stats.prompt_tokens} · cached {stats.cached_tokens}")
    if stats.cached_from:
        t.append(" (")
        parts = sorted(stats.cached_from.items(), key=lambda kv: (kv[0] == stats.user, -kv[1]))
        for i, (who, n) in enumerate(parts):
            if i:
                t.append(", ")
            label = "own" if who == stats.user else inert(who, limit=64)
            t.append(f"{label} {n}", style=_look(looks, who).style)
        t.append(")")
    why = miss_text(getattr(stats, "miss", None), stats.user)
    if why:
        t.append(f" · missed {why}")
    predicted = getattr(stats, "predicted_tokens", None)  # attach: what the mirror said before sending
    if predicted is not None:
        if predicted == stats.cached_tokens:
            t.append(" · as predicted")
        else:
            t.append(f" · predicted {predicted} ≠", style="bold red")
    elif getattr(stats, "unpredictable", False):  # the server's salt decides, not learned yet
        t.append(" · salted: no prediction")
    if timings:
        ttft = "–" if stats.ttft_ms is None else f"{stats.ttft_ms / 1000:.2f} s"
        rate = "–" if not stats.decode_tok_s else f"{stats.decode_tok_s:.0f} tok/s"
        t.append(f" · TTFT {ttft} · {rate}")
    if stats.preemptions:
        t.append(f" · preempted {stats.preemptions}×", style="bold")
    return t


def request_bar(stats, looks: dict[str, UserLook], width: int = 24) -> Text:
    """One request: cached tokens coloured by creator (█), computed tokens (░) in the user's colour."""
    me = _look(looks, stats.user)
    total = max(1, stats.prompt_tokens)
    t = Text()
    t.append(f"{me.glyph} ", style=me.style)
    cells = 0
    for who, n in sorted(stats.cached_from.items(), key=lambda kv: -kv[1]):
        k = round(n * width / total)
        k = min(k, width - cells)
        t.append("█" * k, style=Style(color=_look(looks, who).colour))
        cells += k
    t.append("░" * (width - cells), style=Style(color=me.colour, dim=True))
    t.append(f" {stats.cached_tokens:>4}/{stats.prompt_tokens:<4}", style=DIM)
    return t


def sparkline(values: list[float], width: int = 16) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals)


def stats_text(s: dict) -> Text:
    t = Text()
    t.append("hit rate ", style=DIM)
    t.append(f"{s['hit_rate'] * 100:.0f}%", style="bold")
    t.append(f"  ({s['hit_tokens']:,} of {s['query_tokens']:,} prompt tokens reused)\n", style=DIM)
    t.append("blocks   ", style=DIM)
    t.append(f"in use {s['blocks_in_use']:,} · cached {s['blocks_cached']:,} · free {s['blocks_free']:,}")
    t.append(f" / {s['blocks_total']:,}\n", style=DIM)
    t.append("memory   ", style=DIM)
    t.append(f"{mib(s['used_bytes'])} of {mib(s['pool_bytes'])}")
    t.append("\nsaved    ", style=DIM)
    t.append(mib(s["bytes_saved"]), style="bold")
    t.append(" vs a dedicated cache per user\n", style=DIM)
    t.append("evictions ", style=DIM)
    t.append(str(s["evictions"]))
    t.append(" · preemptions ", style=DIM)
    t.append(str(s["preemptions"]))
    t.append(" · running ", style=DIM)
    t.append(f"{s['running']}")
    t.append(" · waiting ", style=DIM)
    t.append(f"{s['waiting']}")
    return t


def mode_line(s: dict, model: str, device: str = "") -> Text:
    t = Text()
    t.append(inert(model, limit=256), style="bold")
    if device:
        t.append(f" on {inert(device, limit=256)}", style=DIM)
    t.append(f"\n{s['blocks_total']:,} blocks × {s['block_size']} tokens · isolation ", style=DIM)
    t.append(s["isolation"], style="bold")
    t.append("\neviction ", style=DIM)
    t.append(s["eviction"], style="bold")
    t.append(" · deterministic ", style=DIM)
    t.append("on" if s["deterministic"] else "off", style="bold")
    t.append(" · hash ", style=DIM)
    t.append(s["hash"], style="bold")
    return t


def event_line(ev, looks: dict[str, UserLook]) -> str | None:
    """One line for the event log (plain text: the caller makes it inert), or None for events not
    worth a line."""
    k = ev.kind
    if k == "BlockStored":
        return f"{ev.seq:>5} stored  {len(ev.block_ids)} block(s) #{','.join(map(str, ev.block_ids))} by {ev.user}"
    if k == "BlockRemoved":
        return f"{ev.seq:>5} removed {len(ev.block_ids)} block(s) ({ev.reason}) from {','.join(sorted(set(ev.creators))) or '-'}"
    if k == "AllBlocksCleared":
        return f"{ev.seq:>5} cleared all blocks ({ev.reason})"
    if k == "BlockHit":
        by = ", ".join(f"{who} {n}" for who, n in ev.by_creator.items())
        return f"{ev.seq:>5} hit     {ev.user}: {ev.cached_tokens} tokens ({by})"
    if k == "RequestPreempted":
        return f"{ev.seq:>5} PREEMPT {ev.user}: freed {ev.freed_blocks} blocks"
    if k == "CollisionCaught":
        return f"{ev.seq:>5} COLLISION caught for {ev.user} at block {ev.block_id}"
    if k == "MissExplained":
        return f"{ev.seq:>5} missed  {ev.user}: {miss_text(miss_from_event(ev), ev.user)}"
    if k == "RequestFinished":
        return f"{ev.seq:>5} done    {ev.user} ({ev.finish_reason})" + (f": {ev.error}" if ev.error else "")
    if k == "SettingsChanged":
        return f"{ev.seq:>5} SETTING " + ", ".join(f"{name} {ev.previous.get(name)} → {v}"
                                                   for name, v in ev.changes.items())
    if k == "UserGroupChanged":
        return (f"{ev.seq:>5} GROUP   {ev.user}: {ev.old_group or '(none)'} → {ev.new_group or '(none)'}"
                " (from the next request)")
    return None


def legend_text(looks: dict[str, UserLook]) -> Text:
    t = Text()
    for i, look in enumerate(looks.values()):
        if i:
            t.append("  ")
        t.append(f"{look.glyph} ", style=f"bold #000000 on {look.colour}")
        t.append(inert(look.name, limit=64), style=look.style)
    t.append("\n")
    t.append("A", style="bold #000000 on #bbbbbb")
    t.append(" in use · ")
    t.append("a", style="#bbbbbb")
    t.append(" cached · ")
    t.append("a", style="dim #bbbbbb")
    t.append(" under half full · ")
    t.append("·", style=FREE_STYLE)
    t.append(" free · ")
    t.append("a+", style="bold #ffffff on #5a5a5a")
    t.append(" reused by last request\n")
    t.append("colour: who created most of a cell · map keys: +/- zoom, 0 whole pool, j last request, / user",
             style=DIM)
    return t


def range_detail(first: int, arrays, looks: dict[str, UserLook]) -> Text:
    """What a run of blocks holds: `blocks #4,096–#8,191: 120 in use · 800 cached · 3,176 free`
    and who created them (from the state and creator codes of wire.views.BlockArrays)."""
    n = len(arrays.state)
    t = Text()
    t.append(f"blocks #{first:,}–#{first + n - 1:,} ", style="bold")
    counts = np.bincount(arrays.state.astype(np.int64), minlength=3)
    t.append(f"{int(counts[2]):,} in use · {int(counts[1]):,} cached · {int(counts[0]):,} free")
    owned = arrays.creator[(arrays.state != 0) & (arrays.creator >= 0)]
    if len(owned):
        by = np.bincount(owned.astype(np.int64))
        order = [int(c) for c in np.argsort(-by) if by[c]]
        t.append("\ncreated by ")
        for i, code in enumerate(order[:6]):
            name = arrays.users[code] if code < len(arrays.users) else "?"
            if i:
                t.append(", ")
            t.append(f"{inert(name, limit=64)} {int(by[code]):,}", style=_look(looks, name).style)
    t.append("\n+ zooms in; single blocks show their tokens", style=DIM)
    return t


def requests_text(requests: list, looks: dict[str, UserLook], width: int = 30) -> Text:
    bars = Text()
    for i, st in enumerate(requests):
        if i:
            bars.append("\n")
        bars.append_text(request_bar(st, looks, width))
    return bars


def ttft_text(ttft: dict[str, list[float]], looks: dict[str, UserLook], width: int = 20) -> Text:
    t = Text()
    for name, vals in ttft.items():
        look = looks.get(name)
        if look is None or not vals:
            continue
        if t:
            t.append("\n")
        t.append(f"{look.glyph} TTFT ", style=look.style)
        t.append(sparkline(vals, width), style=look.colour)
        t.append(f" {vals[-1] / 1000:.2f} s", style=DIM)
    return t


def block_detail(b, looks: dict[str, UserLook], tokenizer=None, timings: bool = True) -> Text:
    """What one block holds: state, ref count, hits, age, creator, users, hash, tokens as text."""
    t = Text()
    t.append(f"block #{b.block_id} ", style="bold")
    t.append(b.state.replace("_", " "))
    if b.state == "free":
        t.append(" — empty, ready for new tokens")
        return t
    t.append(f" · ref {b.ref_count} · hits {b.hits}")
    if timings and b.created_at:
        t.append(f" · age {max(0.0, time.time() - b.created_at):.0f} s")
    look = looks.get(b.creator)
    t.append("\ncreator ")
    t.append(inert(b.creator, limit=64), style=look.style if look else "")
    if b.users:
        t.append(" · users " + ", ".join(inert(u, limit=64) for u in b.users[:16]) + (" …" if len(b.users) > 16 else ""))
    t.append(f"\nhash {(b.hash or '-')[:16]}…")
    text = ""
    if tokenizer is not None and b.token_ids:
        try:
            text = tokenizer.decode(list(b.token_ids))
        except Exception:
            text = " ".join(map(str, b.token_ids))
    t.append("\ntokens ")
    t.append(inert(repr(text[:400])[:200], limit=None), style="italic")  # repr shows controls; inert the rest
    return t

"""The timeline: requests on a wall-clock axis, in the scrubber and in the live playground.

Each request is one column at the time it was queued: its prompt tokens reused (█, coloured by the
users who created those blocks) under those computed (░, the requesting user's colour), heights
scaled to the largest prompt; below, one row
per user with a TTFT mark at each first token; below that, the axis with the cursor ▲. The
scrubber puts the cursor at the event it shows (click to seek there); the playground keeps the
axis ending at "now", the cursor at the right edge. Requests come as span dicts, made by
`request_spans` (a recording's events) or `result_span` (a live turn's result, from a local
engine or an attached server alike). Drawn to the widget's width on every render, so it follows
resizes.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual import events
from textual.message import Message
from textual.widget import Widget

from kvplay.engine.events import BlockHit, FirstToken, RequestQueued

from .format import DIM, SPARK
from .widgets import refresh_if_taller
from .theme import UNKNOWN_COLOUR

LABEL_W = 9


def request_spans(rec) -> list[dict]:
    """Per request of a Recording: user, queued / first-token wall time, prompt and cached
    tokens, TTFT."""
    by_id: dict[str, dict] = {}
    turns = {t.get("request_id"): t for t in rec.turns}
    for i, e in enumerate(rec.events):
        cls = type(e)
        if cls is not RequestQueued and cls is not BlockHit and cls is not FirstToken:
            continue
        rid = e.request_id
        if not rid:
            continue
        if cls is RequestQueued:
            by_id[rid] = {"rid": rid, "user": e.user, "queued": e.ts, "event": i, "prompt": e.prompt_tokens,
                          "cached": 0, "ttft_ms": None, "first": None, "cached_from": {}}
        elif rid in by_id and cls is BlockHit:
            by_id[rid]["cached"] = e.cached_tokens
            by_id[rid]["cached_from"] = dict(e.by_creator)
        elif rid in by_id and cls is FirstToken:
            by_id[rid]["ttft_ms"], by_id[rid]["first"] = e.ttft_ms, e.ts
    for rid, sp in by_id.items():
        t = turns.get(rid)
        if t is not None and t.get("cached_tokens") is not None and not sp["cached"]:
            sp["cached"] = t["cached_tokens"]
    return sorted(by_id.values(), key=lambda s: s["event"])


def result_span(stats, started: float, order: int) -> dict:
    """The span of one finished live turn (RequestStats, whatever backend ran it), submitted at
    wall time `started`; `order` sorts spans (the app's turn number)."""
    ttft = stats.ttft_ms
    return {"rid": stats.request_id, "user": stats.user, "queued": started, "event": order,
            "prompt": stats.prompt_tokens or 0, "cached": stats.cached_tokens or 0, "ttft_ms": ttft,
            "first": None if ttft is None else started + ttft / 1000, "cached_from": dict(stats.cached_from or {})}


class Timeline(Widget):
    """Requests on a wall-clock axis: reuse per request, TTFT per user, the cursor.

    `live`: the axis ends at now (`follow(now)`), the cursor on its right edge, no seeking.
    `timings=False` (screenshots, tests): requests in order, evenly spaced, no TTFT rows and no
    seconds, so the picture does not depend on the machine's speed."""

    DEFAULT_CSS = "Timeline { height: auto; }"

    class Seek(Message):
        def __init__(self, ts: float) -> None:
            super().__init__()
            self.ts = ts

    def __init__(self, spans: list[dict] | None = None, looks: dict | None = None, t0: float = 0.0,
                 t1: float = 1.0, live: bool = False, timings: bool = True, **kw) -> None:
        super().__init__(**kw)
        self.spans, self.looks = list(spans or []), dict(looks or {})
        self.t0, self.t1 = t0, max(t1, t0 + 1e-3)
        self.cursor_ts = t1 if live else t0
        self.live, self.timings = live, timings
        self.bar_rows = 4

    @property
    def users(self) -> list[str]:
        if not self.timings:
            return []
        return [u for u in self.looks if any(s["user"] == u and s["ttft_ms"] is not None for s in self.spans)]

    def get_content_height(self, container, viewport, width) -> int:
        return self.bar_rows + len(self.users) + 1

    @property
    def span_w(self) -> int:
        return max(10, self.size.width - LABEL_W - 10)

    def _frac(self, ts: float | None) -> float:
        return 0.0 if ts is None else (ts - self.t0) / (self.t1 - self.t0)

    def col(self, ts: float | None) -> int:
        f = self._frac(ts)
        return max(0, min(self.span_w - 1, int(f * (self.span_w - 1) + 0.5)))

    def ts_at(self, x: int) -> float:
        c = max(0, min(self.span_w - 1, x - LABEL_W))
        return self.t0 + (self.t1 - self.t0) * c / max(1, self.span_w - 1)

    # --- feeding ----------------------------------------------------------------------------------
    def set_cursor(self, ts: float | None) -> None:
        self.cursor_ts = self.t0 if ts is None else ts
        self.refresh()

    def set_spans(self, spans: list[dict], looks: dict, now: float | None = None) -> None:
        """Live: the requests so far (and the users' looks); the axis runs from the first to now."""
        self.spans, self.looks = sorted(spans, key=lambda s: s["event"]), dict(looks)
        self.t0 = min((s["queued"] for s in self.spans if s["queued"] is not None), default=self.t0)
        self.follow(now if now is not None else self.t1)
        refresh_if_taller(self, self.bar_rows + len(self.users) + 1)  # a new user's TTFT row

    def follow(self, now: float) -> None:
        """Live: the axis ends at `now`, with the cursor there."""
        last = max((s["first"] or s["queued"] or self.t0 for s in self.spans), default=self.t0)
        self.t1 = max(now, last, self.t0 + 1e-3)
        self.cursor_ts = self.t1
        self.refresh()

    # --- drawing ----------------------------------------------------------------------------------
    def _columns(self) -> list[tuple | None]:
        w = self.span_w
        cols: list[tuple | None] = [None] * w
        n = len(self.spans)
        for i, s in enumerate(self.spans):
            if self.timings:
                c = self.col(s["queued"])
            else:  # in order, evenly spaced
                c = 0 if n < 2 else min(w - 1, int(i * (w - 1) / (n - 1) + 0.5) if n <= w else i * w // n)
            while c < w - 1 and cols[c] is not None:  # requests queued together sit side by side
                c += 1
            past = self.live or (s["queued"] is not None and s["queued"] <= self.cursor_ts)
            cols[c] = (s, past)
        return cols

    def _colour(self, user: str | None) -> str:
        look = self.looks.get(user)
        return look.colour if look else UNKNOWN_COLOUR

    def _reused_colours(self, s: dict, h: int) -> list[str]:
        """The colours of a request's reused cells, bottom up: each creator's share of the cached
        tokens (the largest first), as the request bars and the map colour them."""
        if not s["prompt"] or not s["cached"]:
            return []
        hit = round(h * s["cached"] / s["prompt"])
        shares = sorted((s.get("cached_from") or {}).items(), key=lambda kv: (-kv[1], kv[0]))
        known = sum(n for _, n in shares)
        if known < s["cached"]:  # a server's usage without KV events: cached, from nobody known
            shares.append((None, s["cached"] - known))
        out, done = [], 0
        for who, n in shares:
            done += n
            out += [self._colour(who)] * (round(hit * min(done, s["cached"]) / s["cached"]) - len(out))
        return out

    def _bars(self) -> list[Text]:
        rows = self.bar_rows
        cols = self._columns()
        top = max((s["prompt"] for s in self.spans), default=1) or 1
        lines = []
        for r in range(rows):  # r = 0 is the top row
            t = Text()
            t.append(("computed" if r == 0 else "reused" if r == rows - 1 else "").ljust(LABEL_W), style=DIM)
            for cell in cols:
                if cell is None:
                    t.append(" ")
                    continue
                s, past = cell
                h = max(1, round(rows * s["prompt"] / top))
                reused = self._reused_colours(s, h)
                level = rows - 1 - r  # 0 = bottom row
                if level >= h:
                    t.append(" ")
                elif level < len(reused):
                    t.append("█", style=Style(color=reused[level], dim=not past))
                else:
                    t.append("░", style=Style(color=self._colour(s["user"]), dim=not past))
            lines.append(t)
        return lines

    def _ttft(self) -> list[Text]:
        w = self.span_w
        top = max((s["ttft_ms"] or 0 for s in self.spans), default=1) or 1
        lines = []
        for u in self.users:
            look = self.looks[u]
            t = Text()
            t.append(f"{look.glyph} TTFT".ljust(LABEL_W), style=look.style)
            row = [" "] * w
            for s in self.spans:
                if s["user"] == u and s["ttft_ms"] is not None:
                    row[self.col(s["first"] or s["queued"])] = SPARK[min(len(SPARK) - 1, int(s["ttft_ms"] / top * (len(SPARK) - 1)))]
            t.append("".join(row), style=look.colour)
            if self.live:  # the latest, as the request bars' sparklines say it
                last = [s["ttft_ms"] for s in self.spans if s["user"] == u and s["ttft_ms"] is not None][-1]
                t.append(f" {last / 1000:.2f} s", style=DIM)
            lines.append(t)
        return lines

    def _axis(self) -> Text:
        w = self.span_w
        c = w - 1 if self.live else self.col(self.cursor_ts)
        t = Text()
        if not self.timings:
            t.append("".ljust(LABEL_W))
        elif self.live:
            t.append(f"-{self.t1 - self.t0:.1f} s".ljust(LABEL_W), style=DIM)
        else:
            t.append(f"{self.cursor_ts - self.t0:6.2f} s ".ljust(LABEL_W), style="bold")
        t.append("─" * c, style=DIM)
        t.append("▲", style="bold")
        t.append("─" * (w - c - 1), style=DIM)
        if self.live:
            t.append(" now", style="bold")
        elif self.timings:
            t.append(f" {self.t1 - self.t0:.1f} s", style=DIM)
        return t

    def render(self) -> Text:
        lines = self._bars() + self._ttft() + [self._axis()]
        return Text("\n").join(lines)

    def on_click(self, event: events.Click) -> None:
        if not self.live and event.x >= LABEL_W:
            self.post_message(self.Seek(self.ts_at(event.x)))

"""The scrubber: step, play and seek through a recorded session's cache history, no model loaded.

The block map, the stats, the per-user panes and the event line show the pool as it stood after
the event under the cursor (sessions.history rebuilds it from the recorded events alone). The
timeline below (tui/timeline.py, the playground's too) puts every request on the session's
wall-clock axis: its prompt tokens reused (coloured by their blocks' creators) and computed (the
user's colour), and each user's TTFT; the cursor is the ▲; click it to seek there.

Keys: ←/→ one event, [/] (shift+←/→) one turn, space play/pause, s (or 1/2/4/8) speed 1x/2x/4x/8x,
g go to a turn, t the prefix tree at the cursor (tui/tree_view.py; its text from the session's
tokenizer when it is on this machine, loaded the first time; the nodes the event under the cursor
stored, reused or evicted are marked), home/end, escape closes.
"""
from __future__ import annotations

from types import SimpleNamespace

from rich.text import Text
from textual import on, work
from textual.app import App
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Static

from kvplay.engine.errors import EngineError
from kvplay.engine.events import RequestFinished, RequestQueued
from kvplay.inert import inert
from kvplay.sessions.history import History, PoolState, Recording, load_recording, turn_ends
from kvplay.sessions.store import open_db
from kvplay.sessions.tokenizer import session_detokenizer

from .blockmap import BlockMap
from .format import DIM, badge, block_detail, event_line, legend_text, stats_text
from .panes import body, user_label
from .screens import SCRUB_HELP, HelpScreen
from .theme import assign_looks
from .timeline import Timeline, request_spans
from .tree_view import MirrorTrees, TreeScreen
from .widgets import InertNotify

SPEEDS = (1, 2, 4, 8)
TICK_S = 0.05
MAX_GAP_S = 1.0  # playing compresses idle gaps longer than this


class _IdsDecoder:
    """The scrubber loads no tokenizer: a block's tokens are shown as ids."""

    def decode(self, ids, **_) -> str:
        return " ".join(map(str, ids))


class ScrubScreen(Screen):
    """A recorded session, scrubbed: every view shows the state after the event at the cursor."""

    DEFAULT_CSS = """
    ScrubScreen { layout: vertical; }
    #scrub-main { height: 1fr; }
    #scrub-panes { width: 1fr; padding: 0 1; }
    .scrub-pane { height: 1fr; border: round $accent; padding: 0 1; }
    #scrub-side { width: 40%; max-width: 56; min-width: 36; border-left: vkey $panel-lighten-2; padding: 0 1; }
    #scrub-side .section { text-style: bold; margin-top: 1; }
    #scrub-map { height: auto; max-height: 18; min-height: 2; background: transparent; }
    #scrub-detail { height: auto; min-height: 3; color: $text-muted; border-top: dashed $panel-lighten-2; }
    #scrub-timeline { border-top: solid $panel-lighten-2; padding: 0 1; }
    #scrub-event { height: 1; padding: 0 1; color: $text-muted; }
    #scrub-goto { display: none; }
    #scrub-goto.shown { display: block; }
    """

    BINDINGS = [
        Binding("right,l", "step(1)", "Event →", id="scrub.next_event"),
        Binding("left,h", "step(-1)", "Event ←", id="scrub.prev_event"),
        Binding("right_square_bracket,shift+right", "turn(1)", "Turn →", id="scrub.next_turn"),
        Binding("left_square_bracket,shift+left", "turn(-1)", "Turn ←", id="scrub.prev_turn"),
        Binding("space", "play", "Play/pause", id="scrub.play"),
        Binding("s", "speed", "Speed", id="scrub.speed"),
        *[Binding(str(n), f"set_speed({n})", f"{n}x", show=False, id=f"scrub.speed{n}") for n in SPEEDS],
        Binding("g", "goto", "Go to turn", id="scrub.goto"),
        Binding("t", "tree", "Tree", id="scrub.tree"),
        Binding("f1", "help", "Help", id="scrub.help"),
        Binding("home", "seek(0)", "Start", show=False, id="scrub.start"),
        Binding("end", "seek(-1)", "End", show=False, id="scrub.end"),
        Binding("escape", "close", "Close", id="scrub.close"),
    ]

    def __init__(self, recording: Recording, cursor: int | None = None) -> None:
        super().__init__()
        self.rec = recording
        self.history = History(recording.batches, recording.num_blocks)
        names = [u["name"] for u in recording.users]
        names += [t["user"] for t in recording.turns if t["user"] not in names]
        self.looks = assign_looks(names, {u["name"]: u.get("colour") for u in recording.users})
        self.spans = request_spans(recording)
        ts = [e.ts for e in recording.events]
        self.t0, self.t1 = (min(ts), max(ts)) if ts else (0.0, 1.0)
        self._play_t = self._compressed(ts)
        self.turn_ends = turn_ends(recording)
        self._queued_at: dict[str, int] = {}  # request id -> events applied once it was queued / finished
        self._finished_at: dict[str, int] = {}
        for i, e in enumerate(recording.events):
            if type(e) is RequestQueued:
                self._queued_at.setdefault(e.request_id, i + 1)
            elif type(e) is RequestFinished:
                self._finished_at[e.request_id] = i + 1
        self.cursor = len(recording.events) if cursor is None else max(0, min(cursor, len(recording.events)))
        self.playing = False
        self.speed = 1
        self._vt = 0.0
        self._timer = None
        self.state: PoolState | None = None
        self._detail: int | None = None
        self._detok = None  # the session's tokenizer's decode, once loaded (for the tree)
        self._detok_tried = False

    @staticmethod
    def _compressed(ts: list[float]) -> list[float]:
        out, t = [], 0.0
        for i, x in enumerate(ts):
            if i:
                t += max(0.0, min(MAX_GAP_S, x - ts[i - 1]))
            out.append(t)
        return out

    # --- layout -------------------------------------------------------------------------------
    def compose(self):
        yield Header(show_clock=False)
        with Horizontal(id="scrub-main"):
            with Vertical(id="scrub-panes"):
                for name, look in self.looks.items():
                    box = VerticalScroll(Static("", classes="scrub-log"), classes="scrub-pane")
                    box.border_title = user_label(look.glyph, name)
                    box.styles.border = ("round", look.colour)
                    box.styles.border_title_color = look.colour
                    yield box
            with VerticalScroll(id="scrub-side"):
                yield Static(id="scrub-status")
                yield Static("Block pool", classes="section")
                yield BlockMap(id="scrub-map")
                yield Static(legend_text(self.looks), id="scrub-legend")
                yield Static(Text("click a block (or focus the map and use the arrows) to see it"), id="scrub-detail")
                yield Static("Stats", classes="section")
                yield Static(id="scrub-stats")
        yield Timeline(self.spans, self.looks, self.t0, self.t1, id="scrub-timeline")
        yield Static(id="scrub-event")
        yield Input(placeholder="go to turn number (Enter), escape cancels", id="scrub-goto")
        yield Footer()

    def on_mount(self) -> None:
        s = self.rec.session
        self.title = f"kvplay scrub {inert(s['id'], limit=64)}"
        self.sub_title = inert(f"{s.get('source')} · {s.get('model')} · {len(self.rec.turns)} turns · "
                               f"{len(self.rec.events)} events", limit=512)
        self.show()

    # --- the cursor -----------------------------------------------------------------------------
    def seek(self, n: int) -> None:
        self.cursor = max(0, min(n, len(self.rec.events)))
        self.show()

    def show(self) -> None:
        st = self.history.state(self.cursor)
        self.state = st
        self.query_one(BlockMap).set_source(st.mirror, self.looks, st.hit)
        self.query_one("#scrub-stats", Static).update(stats_text(self._stats(st)))
        self.query_one("#scrub-status", Static).update(self._status(st))
        self.query_one(Timeline).set_cursor(st.ts)
        self.query_one("#scrub-event", Static).update(self._event_text())
        self._panes()
        if self._detail is not None:
            self._show_detail(self._detail)

    def _status(self, st: PoolState) -> Text:
        cfg = self.rec.session.get("engine_config") or {}
        t = Text()
        t.append("▶ playing" if self.playing else "❚❚ paused", style="bold")
        t.append(f" {self.speed}x", style="bold")
        t.append(f" · event {self.cursor}/{len(self.rec.events)}", style=DIM)
        done = sum(1 for e in self.turn_ends if e <= self.cursor)
        t.append(f" · turn {done}/{len(self.turn_ends)}", style=DIM)
        t.append(f"\n{self.rec.num_blocks} blocks × {cfg.get('block_size', '?')} tokens · isolation ", style=DIM)
        t.append(str(cfg.get("isolation", "?")), style="bold")
        t.append(" · eviction ", style=DIM)
        t.append(str(cfg.get("eviction", "?")), style="bold")
        return t

    def _stats(self, st: PoolState) -> dict:
        bb = (self.rec.session.get("stats") or {}).get("block_bytes") or 0
        m = st.mirror
        free, cached, in_use = m.counts()
        resident = cached + in_use
        return {"hit_rate": st.hit_rate, "hit_tokens": st.hit_tokens, "query_tokens": st.query_tokens,
                "blocks_in_use": in_use, "blocks_cached": cached,
                "blocks_free": free, "blocks_total": m.num_blocks, "used_bytes": bb * resident,
                "pool_bytes": bb * m.num_blocks, "bytes_saved": bb * (m.dedicated() - resident),
                "evictions": st.evictions, "preemptions": st.preemptions, "running": st.running,
                "waiting": st.waiting}

    def _event_text(self) -> Text:
        if self.cursor == 0:
            return Text("before the first event (→ steps, space plays)", style=DIM)
        ev = self.rec.events[self.cursor - 1]
        return Text(inert(event_line(ev, self.looks) or f"{ev.seq:>5} {ev.kind} {getattr(ev, 'user', '')}", limit=1024))

    def _panes(self) -> None:
        big = len(self.rec.events) + 1
        for box, (name, look) in zip(self.query(".scrub-pane"), self.looks.items()):
            t = Text()
            for turn in (t_ for t_ in self.rec.turns if t_["user"] == name):
                rid = turn.get("request_id")
                if self._queued_at.get(rid, big) > self.cursor:
                    continue
                if t:
                    t.append("\n")
                t.append("› " + body(turn["text"]) + "\n", style=look.style)
                if self._finished_at.get(rid, big) <= self.cursor:
                    t.append(body((turn.get("reply") or turn.get("error") or "")[:200]) + "\n")
                    st = SimpleNamespace(user=name, prompt_tokens=turn.get("prompt_tokens") or 0,
                                         cached_tokens=turn.get("cached_tokens") or 0,
                                         cached_from=turn.get("cached_from") or {}, ttft_ms=turn.get("ttft_ms"),
                                         decode_tok_s=turn.get("decode_tok_s"), preemptions=turn.get("preemptions") or 0,
                                         miss=turn.get("miss"))
                    t.append_text(badge(st, self.looks, timings=True))
                else:
                    t.append("…", style=DIM)
            box.query_one(".scrub-log", Static).update(t if t else Text("(no turn yet)", style=DIM))
            box.scroll_end(animate=False)

    # --- details ------------------------------------------------------------------------------
    @on(BlockMap.CellSelected)
    def _on_cell(self, msg: BlockMap.CellSelected) -> None:
        self._detail = msg.block_id
        self._show_detail(msg.block_id)

    def _show_detail(self, block_id: int) -> None:
        view = None if self.state is None else self.state.mirror.block(block_id)
        if view is None:
            return
        self.query_one("#scrub-detail", Static).update(block_detail(view, self.looks, _IdsDecoder(), timings=False))

    @on(Timeline.Seek)
    def _on_seek(self, msg: Timeline.Seek) -> None:
        n = sum(1 for e in self.rec.events if e.ts <= msg.ts)
        self.seek(n)

    # --- actions ------------------------------------------------------------------------------
    def action_step(self, d: int) -> None:
        self.seek(self.cursor + d)

    def action_turn(self, d: int) -> None:
        if d > 0:
            nxt = next((e for e in self.turn_ends if e > self.cursor), len(self.rec.events))
        else:
            nxt = next((e for e in reversed(self.turn_ends) if e < self.cursor), 0)
        self.seek(nxt)

    def action_seek(self, n: int) -> None:
        self.seek(len(self.rec.events) if n < 0 else n)

    def goto_turn(self, k: int) -> None:
        """Put the cursor just after turn k (1-based, in the order turns finished) finished."""
        if 1 <= k <= len(self.turn_ends):
            self.seek(self.turn_ends[k - 1])
        else:
            self.notify(f"turns run from 1 to {len(self.turn_ends)}", severity="warning")

    def action_goto(self) -> None:
        box = self.query_one("#scrub-goto", Input)
        box.add_class("shown")
        box.value = ""
        box.focus()

    @on(Input.Submitted, "#scrub-goto")
    def _on_goto(self, msg: Input.Submitted) -> None:
        msg.input.remove_class("shown")
        try:
            self.goto_turn(int(msg.value.strip()))
        except ValueError:
            self.notify("give a turn number", severity="warning")
        self.set_focus(None)

    def action_speed(self) -> None:
        self.action_set_speed(SPEEDS[(SPEEDS.index(self.speed) + 1) % len(SPEEDS)])

    def action_set_speed(self, n: int) -> None:
        self.speed = n
        self.show()

    def action_play(self) -> None:
        self.playing = not self.playing
        if self.playing:
            if self.cursor >= len(self.rec.events):
                self.cursor = 0
            self._vt = self._play_t[self.cursor - 1] if self.cursor else 0.0
            if self._timer is None:
                self._timer = self.set_interval(TICK_S, self._tick)
        self.show()

    def _tick(self) -> None:
        if not self.playing:
            return
        self._vt += TICK_S * self.speed
        n = self.cursor
        while n < len(self._play_t) and self._play_t[n] <= self._vt:
            n += 1
        if n >= len(self.rec.events):
            self.playing = False
        if n != self.cursor or not self.playing:
            self.seek(n)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(SCRUB_HELP))

    def action_tree(self) -> None:
        """The prefix tree as it stood after the event under the cursor (the History's Mirror there)."""
        st = self.state or self.history.state(self.cursor)
        m = st.mirror.copy()
        before = None
        if self.cursor:  # the tree marks what this step changed: the one before it, from the History
            before = MirrorTrees(self.history.state(self.cursor - 1).mirror.copy()).snapshot()
            self.history.state(self.cursor)  # the History's cursor back where the screen is
        source = MirrorTrees(m, self._detok, m, before=before)
        screen = TreeScreen(source, self.looks, title=f"Prefix tree after event {self.cursor}/{len(self.rec.events)}",
                            at=st.ts or None)
        self.app.push_screen(screen)
        if self._detok is None and not self._detok_tried:
            self._detok_tried = True
            self._load_tokenizer(screen)

    @work(thread=True, exit_on_error=False, group="tokenizer", description="Loading the session's tokenizer")
    def _load_tokenizer(self, screen: TreeScreen) -> None:
        detok = session_detokenizer(self.rec.session.get("model"))
        if detok is not None:
            self._detok = detok
            self.app.call_from_thread(self._labels_ready, screen, detok)

    def _labels_ready(self, screen: TreeScreen, detok) -> None:
        if screen.is_attached:
            screen.labels.detokenize = detok
            if screen.ready:
                screen.populate()

    def action_close(self) -> None:
        box = self.query_one("#scrub-goto", Input)
        if box.has_class("shown"):
            box.remove_class("shown")
            self.set_focus(None)
            return
        if len(self.app.screen_stack) > 2 or not isinstance(self.app, ScrubApp):
            self.app.pop_screen()
        else:
            self.app.exit()


class ScrubApp(InertNotify, App):
    """`kvplay scrub`: the scrubber on its own, no engine."""

    TITLE = "kvplay scrub"
    BINDINGS = [Binding("ctrl+q,q", "quit", "Quit", id="app.quit", priority=True)]

    def __init__(self, recording: Recording, cursor: int | None = None) -> None:
        super().__init__()
        self.recording = recording
        self.start_cursor = cursor

    def on_mount(self) -> None:
        self.push_screen(ScrubScreen(self.recording, self.start_cursor))


def open_in_app(app) -> None:
    """From the playground's palette: scrub the session it is recording, up to now."""
    rec = getattr(app, "recorder", None)
    if rec is None:
        app.notify("This session is not recorded (--no-record), so there is nothing to scrub.", severity="warning")
        return
    try:
        rec.flush()
        db = open_db(app.recording.db, create=False)
        try:
            recording = load_recording(db, rec.session_id)
        finally:
            db.close()
    except EngineError as exc:
        app.notify(str(exc), severity="warning")
        return
    app.push_screen(ScrubScreen(recording))

"""The cache room: the side panel of the pool's views (block map, block details, request bars,
timeline, stats, the event log, the prefix tree) and their coalesced redraw.

`CacheRoom` is the panel itself (a widget): it subscribes to the backend's event batches, keeps
what its views need (hit and flash sets, each request's blocks, the finished requests, the
counters) and redraws at most 15 times a second. The views read the backend's mirror of the
pool, fed by the engine's event batches (or a server's KV events): the map reads it in ranges,
the stats panel its counters, the tree a Mirror of the same events. Batches queue up as they
come (deque.append is thread-safe) and the tick takes them in one go and redraws only what
their events marked dirty.
"""
from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual import work
from textual.containers import VerticalScroll
from textual.widgets import Log, Static

from kvplay.inert import inert

from .blockmap import BlockMap
from .controls import without_labs
from .format import block_detail, event_line, legend_text, mode_line, range_detail, stats_text
from .timeline import Timeline, result_span
from .tree_view import MirrorTrees, TreeScreen
from .widgets import RequestBars, update_static

EVENT_LINES = 500  # the event log (F10) keeps this many lines
REFRESH_HZ = 15


class CacheRoom(VerticalScroll):
    """The views of the shared pool, fed by the backend's events (`listen`, then `bind`).
    `looks` is the app's dict of users' looks, shared (updated in place as users come)."""

    def __init__(self, model: str, looks: dict, timings: bool = True, flash_s: float = 0.8, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model, self.looks, self.timings = model, looks, timings
        self.flash_s = flash_s if timings else 0.0
        self.backend = None  # the ChatBackend whose pool this panel shows, once ready
        self._unsubscribe = None
        self._event_queue: deque = deque()  # event batches not yet taken in (see _tick)
        self._event_lines: deque[str] = deque(maxlen=EVENT_LINES)  # the event log, drawn when shown
        self._dirty = False
        self._refreshing = False
        self._hit: set[int] = set()
        self._flash: set[int] = set()
        self._flash_until = 0.0
        self._request_blocks: dict[str, set[int]] = {}  # blocks each running request hit or stored
        self.last_blocks: set[int] = set()  # ... of the last request that finished
        self.requests: deque = deque(maxlen=200)  # the finished requests' stats (the bars)
        self._spans: deque = deque(maxlen=500)  # the timeline's requests (tui/timeline.py)
        self._ttft: dict[str, list[float]] = {}
        self._timeline_at = 0.0
        self._excluded: dict[str, int] = {}  # counters of lab runs, not the app's own (controls.py)
        self.stats: dict | None = None  # the counters last shown
        self._detail_block: tuple[int, int] | None = None

    def compose(self):
        yield Static(Text(f"loading the model ({inert(self.model, limit=256)}) …", style="bold"), id="status")
        yield Static(id="lab-progress")  # a lab run from the palette: its phase and steps
        yield Static("Block pool", classes="section", id="map-title")
        yield BlockMap(id="map")
        yield Static(id="legend")
        yield Static(Text("hover or click a block (ctrl+b, arrows) to see what it holds"), id="detail")
        yield Static("Requests · cached █ vs computed ░", classes="section")
        yield RequestBars(id="bars")
        yield Static("Timeline · cached █ computed ░" + (" · TTFT" if self.timings else ""),
                     classes="section", id="timeline-title")
        yield Timeline(live=True, timings=self.timings, id="timeline")
        yield Static("Cache", classes="section")
        yield Static(id="stats")
        yield Log(id="events", max_lines=EVENT_LINES)

    def on_mount(self) -> None:
        self.update_legend()
        self.set_interval(1 / REFRESH_HZ, self._tick)

    # --- the event stream -------------------------------------------------------------------
    def listen(self, source) -> None:
        """Take `source`'s event batches (an Engine or a backend: `subscribe_batches(fn)`); any
        thread. One message per batch (one per engine step) would crowd out keystrokes: they
        queue here and the tick takes them in one go."""
        self._unsubscribe = source.subscribe_batches(self._on_batch)

    def _on_batch(self, batch) -> None:
        if batch.events:
            self._event_queue.append(batch)

    def unsubscribe(self) -> None:
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe:
            unsubscribe()

    def bind(self, backend) -> None:
        """The backend is ready: the map reads its pool."""
        self.backend = backend
        self.query_one("#map", BlockMap).set_source(backend, self.looks)
        self._dirty = True

    def show_loading(self, text: str) -> None:
        """The model's loading progress, where the status line will be."""
        self.query_one("#status", Static).update(Text(inert(text, limit=1024), style="bold"))

    def maps_ready(self) -> None:
        """The map has its source; an attached fleet adds one map per pod here (attach.py)."""

    @property
    def settled(self) -> bool:
        """Every engine event taken in and the counters and map redrawn (tests, screenshots)."""
        return not self._event_queue and not self._dirty and not self._refreshing

    def mark_dirty(self) -> None:
        """The pool changed (a control, a lab, a turn): the next tick re-reads the counters and
        the map. Any thread."""
        self._dirty = True

    def _take_events(self) -> None:
        q = self._event_queue
        n = len(q)
        if not n:
            return
        events = [ev for _ in range(n) for ev in q.popleft().events]
        for ev in events:
            self._note_event(ev)
        lines = []  # only the newest lines survive in the event log: format those alone
        for ev in reversed(events):
            line = event_line(ev, self.looks)
            if line:
                lines.append(inert(line, limit=1024))  # names, errors: a server's session ids among them
                if len(lines) == EVENT_LINES:
                    break
        lines.reverse()
        self._log_events(lines)

    def _log_events(self, lines: list[str]) -> None:
        """The event log keeps its last lines; the Log widget is written only while it is shown
        (a hidden one still asked for a layout pass per write)."""
        if not lines:
            return
        self._event_lines.extend(lines)
        log = next(iter(self.query("#events").results(Log)), None)  # gone while the app closes
        if log is not None and log.has_class("shown"):
            log.write_lines(lines)

    @property
    def events_shown(self) -> bool:
        return self.query_one("#events", Log).has_class("shown")

    def show_events(self, shown: bool) -> None:
        """Show or hide the event log: shown, it is brought into view (the panel's last item,
        below the fold with four users)."""
        log = self.query_one("#events", Log)
        log.set_class(shown, "shown")
        log.clear()
        if shown:
            log.write_lines(list(self._event_lines))
            self.call_after_refresh(self.scroll_end, animate=False)  # the log is last

    def _note_event(self, ev) -> None:
        """What the map and the jump key need from an event: hit and flash sets, the blocks of
        each running request (a remote server's events name no request)."""
        self._dirty = True
        kind = ev.kind
        if kind == "BlockHit":
            self._hit = set(ev.block_ids)
            if self.flash_s:
                self._flash = set(ev.block_ids)
                self._flash_until = time.monotonic() + self.flash_s
        elif kind == "RequestStarted" and ev.cached_tokens == 0:
            self._hit = set()
        elif kind == "AllBlocksCleared":
            self._hit = set()
            self.last_blocks = set()
        rid = getattr(ev, "request_id", None)
        if rid is None:
            return
        if kind in ("BlockHit", "BlockStored"):
            self._request_blocks.setdefault(rid, set()).update(ev.block_ids)
        elif kind == "RequestFinished":
            self.last_blocks = self._request_blocks.pop(rid, set()) or self.last_blocks

    # --- the coalesced redraw ---------------------------------------------------------------
    def _tick(self) -> None:
        if self.backend is None:
            return
        self._take_events()
        if self.timings and self._spans and time.monotonic() - self._timeline_at >= 1.0:
            self._timeline_at = time.monotonic()  # the timeline's axis ends at now
            self.query_one(Timeline).follow(time.time())
        if self._flash and time.monotonic() > self._flash_until:
            self._flash = set()
            self._redraw_map()
        if self._dirty and not self._refreshing:
            self._dirty = False
            self._refreshing = True
            self._fetch_state()

    @work(thread=True, exit_on_error=False, group="refresh", description="Reading the counters")
    def _fetch_state(self) -> None:
        # stats() waits for the engine's lock (between steps): off the UI thread, and never long.
        # The map reads the pool itself, in ranges (BlockMap.set_source).
        try:
            stats = self.backend.stats(timeout=0.2)
        except Exception:
            stats = None
        self.app.call_from_thread(self._apply_state, stats)

    def _apply_state(self, stats) -> None:
        self._refreshing = False
        if stats is not None:
            stats = without_labs(stats, self._excluded)
            self.stats = stats
            update_static(self.query_one("#stats", Static), self.stats_view(stats))
            update_static(self.query_one("#status", Static), self.status_view(stats))
        self._redraw_map()
        if self._detail_block is not None:
            self._show_detail(*self._detail_block)

    def stats_view(self, stats: dict) -> Text:
        return stats_text(stats)

    def status_view(self, stats: dict) -> Text:
        return mode_line(stats, self.backend.model_name, self.backend.device)

    def _redraw_map(self) -> None:
        # the maps on screen: this panel's (one, or one per pod of an attached fleet), or the
        # map of a screen opened over it (the prefix tree's)
        for bm in self.app.screen.query(BlockMap):
            if not getattr(bm, "own_marks", False):  # the tree view's map marks its node's blocks
                bm.looks, bm.hit, bm.flash = self.looks, bm.local(self._hit), bm.local(self._flash)
            bm._rebuild()

    def exclude(self, counts: dict[str, int]) -> None:
        """Counters a lab's requests added to the engine's: the panel's numbers leave them out."""
        for k, v in counts.items():
            self._excluded[k] = self._excluded.get(k, 0) + v

    def show_lab_progress(self, text: str | None) -> None:
        box = self.query_one("#lab-progress", Static)
        box.update(Text(inert(text or "", limit=1024)))
        box.set_class(bool(text), "shown")

    # --- requests, the timeline ---------------------------------------------------------------
    def turn_finished(self, user: str, turn_id: int, stats, started: float | None) -> None:
        """A turn's reply is done: its bar, its span on the timeline, its TTFT."""
        self.requests.append(stats)
        if started is not None and stats.prompt_tokens:
            self._spans.append(result_span(stats, started, turn_id))
            self.query_one(Timeline).set_spans(list(self._spans), self.looks, time.time())
        if stats.ttft_ms is not None:
            self._ttft.setdefault(user, []).append(stats.ttft_ms)
        self.update_requests()
        self._dirty = True

    def update_requests(self) -> None:
        self.query_one(RequestBars).show(list(self.requests)[-6:], self._ttft, self.looks, self.timings)

    def update_legend(self) -> None:
        self.query_one("#legend", Static).update(legend_text(self.looks))

    # --- the map and its details --------------------------------------------------------------
    def on_block_map_view_changed(self, msg: BlockMap.ViewChanged) -> None:
        bm = msg.blockmap
        for title in self.query(f"#{bm.id}-title"):
            update_static(title, Text.assemble((inert(bm.label, limit=256), "bold"), ("  " + bm.scale_text(), "")))

    def jump(self, bm: BlockMap) -> None:
        """Show the blocks of the last request that finished on map `bm` (its jump key)."""
        if not self.last_blocks:
            self.app.notify("No request has finished yet: nothing to jump to.")
        elif not bm.local(self.last_blocks):
            self.app.notify(f"The last request's blocks are not in {bm.label}.")
        else:
            bm.show_blocks(bm.local(self.last_blocks))

    def on_block_map_cell_selected(self, msg: BlockMap.CellSelected) -> None:
        first = msg.block_id + (msg.blockmap.offset if msg.blockmap is not None else 0)
        self._detail_block = (first, msg.blocks)
        self._show_detail(first, msg.blocks)

    def block_detail(self, block_id: int, blocks: int = 1) -> Text:
        if self.backend is None or not 0 <= block_id < self.backend.num_blocks:
            return Text("")
        if blocks > 1:
            return range_detail(block_id, self.backend.arrays(block_id, block_id + blocks), self.looks)
        view = self.backend.block(block_id)
        if view is None:
            return Text("")
        return block_detail(view, self.looks, self.backend, self.timings)

    def focus_map(self) -> None:
        self.query_one(BlockMap).focus()

    def select_block(self, block_id: int) -> None:
        """Show single blocks with the map's cursor on `block_id`, and its details."""
        bm = self.query_one(BlockMap)
        bm.focus()
        bm.set_scale(1, max(0, min(block_id, max(0, bm.num_blocks - 1))))
        self._detail_block = (bm.cursor, 1)
        self._show_detail(bm.cursor)

    def _show_detail(self, block_id: int, blocks: int = 1) -> None:
        for panel in self.query("#detail"):  # none while the app is tearing down (a late CellSelected)
            update_static(panel, self.block_detail(block_id, blocks))

    # --- the prefix tree ----------------------------------------------------------------------
    def tree_source(self):
        """What the tree view reads: the backend's Mirror of the engine's events (wire/mirror.py)."""
        b = self.backend
        return MirrorTrees(b.mirror, b.decode, b, lock=b._lock, marks=getattr(getattr(b, "misses", None), "marks", None))

    def toggle_tree(self) -> None:
        """Open the prefix tree over the app's screen (or close it)."""
        if isinstance(self.app.screen, TreeScreen):
            self.app.pop_screen()
            return
        if self.backend is None:
            self.app.notify("The model is still loading: no cache yet.", severity="warning")
            return
        self.app.push_screen(TreeScreen(self.tree_source(), self.looks))

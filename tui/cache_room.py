"""The cache room: the views of the pool (block map, block details, request bars, timeline,
stats, the event log, the prefix tree) and their coalesced redraw.

The views read the backend's mirror of the pool, fed by the engine's event batches (or a
server's KV events): the map reads it in ranges, the stats panel its counters, the tree a Mirror
of the same events. Events queue up as they come (deque.append is thread-safe) and a 15 Hz tick
takes them in one go and redraws only what they marked dirty.
"""
from __future__ import annotations

import time

from rich.text import Text
from textual import work
from textual.widgets import Log, Static

from .blockmap import BlockMap
from .controls import without_labs
from .format import block_detail, event_line, legend_text, mode_line, range_detail, stats_text
from .timeline import Timeline
from .tree_view import MirrorTrees, TreeScreen
from .widgets import CACHE_TAB, PaneSwitcher, RequestBars, update_static

EVENT_LINES = 500  # the event log (F10) keeps this many lines


class CacheRoom:
    """Events in, views redrawn (a part of KvplayApp: it reads the app's backend and looks)."""

    @property
    def settled(self) -> bool:
        """Every engine event taken in and the counters and map redrawn (tests, screenshots)."""
        return not self._event_queue and not self._dirty and not self._refreshing

    def _take_events(self) -> None:
        q = self._event_queue
        n = len(q)
        if not n:
            return
        events = [q.popleft() for _ in range(n)]
        for ev in events:
            self._note_event(ev)
        lines = []  # only the newest lines survive in the event log: format those alone
        for ev in reversed(events):
            line = event_line(ev, self.looks)
            if line:
                lines.append(line)
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

    def show_events(self, shown: bool) -> None:
        """Show or hide the event log: shown, it is brought into view (the panel's last item, below
        the fold with four users; compact: on the cache tab)."""
        log = self.query_one("#events", Log)
        log.set_class(shown, "shown")
        log.clear()
        if shown:
            log.write_lines(list(self._event_lines))
            if self.compact and not self.screen.has_class("show-cache"):
                self.query_one(PaneSwitcher).active = CACHE_TAB
            self.call_after_refresh(self.query_one("#side").scroll_end, animate=False)  # the log is last

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
            self._last_blocks = set()
        rid = getattr(ev, "request_id", None)
        if rid is None:
            return
        if kind in ("BlockHit", "BlockStored"):
            self._request_blocks.setdefault(rid, set()).update(ev.block_ids)
        elif kind == "RequestFinished":
            self._last_blocks = self._request_blocks.pop(rid, set()) or self._last_blocks

    def _tick(self) -> None:
        if self.recorder_error and not self._recorder_error_shown:
            self._recorder_error_shown = True
            self.notify(f"Recording stopped working: {self.recorder_error}. The playground carries on; "
                        "use --no-record to silence this.", severity="warning", timeout=10)
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
        self.call_from_thread(self._apply_state, stats)

    def _apply_state(self, stats) -> None:
        self._refreshing = False
        if stats is not None:
            stats = without_labs(stats, self._excluded)
            self._stats = stats
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
        for bm in self.query(BlockMap):  # one map, or one per pod of an attached fleet
            if not getattr(bm, "own_marks", False):  # the tree view's map marks its node's blocks
                bm.looks, bm.hit, bm.flash = self.looks, bm.local(self._hit), bm.local(self._flash)
            bm._rebuild()

    def on_block_map_view_changed(self, msg: BlockMap.ViewChanged) -> None:
        bm = msg.blockmap
        for title in self.query(f"#{bm.id}-title"):
            update_static(title, Text.assemble((bm.label, "bold"), ("  " + bm.scale_text(), "")))

    def on_block_map_jump_requested(self, msg: BlockMap.JumpRequested) -> None:
        if not self._last_blocks:
            self.notify("No request has finished yet: nothing to jump to.")
        elif not msg.blockmap.local(self._last_blocks):
            self.notify(f"The last request's blocks are not in {msg.blockmap.label}.")
        else:
            msg.blockmap.show_blocks(msg.blockmap.local(self._last_blocks))

    def _update_legend(self) -> None:
        self.query_one("#legend", Static).update(legend_text(self.looks))

    def _update_requests(self) -> None:
        self.query_one(RequestBars).show(list(self._requests)[-6:], self._ttft, self.looks, self.timings)

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

    def tree_source(self):
        """What the tree view reads: the backend's Mirror of the engine's events (wire/mirror.py)."""
        b = self.backend
        return MirrorTrees(b.mirror, b.decode, b, lock=b._lock)

    def action_prefix_tree(self) -> None:
        if isinstance(self.screen, TreeScreen):
            self.pop_screen()
            return
        if self.backend is None:
            self.notify("The model is still loading: no cache yet.", severity="warning")
            return
        self.push_screen(TreeScreen(self.tree_source(), self.looks))

    def mark_dirty(self) -> None:
        """The pool changed (a control or a lab): the next tick re-reads the counters and the map."""
        self._dirty = True

    def exclude(self, counts: dict[str, int]) -> None:
        """Counters a lab's requests added to the engine's: the app's numbers leave them out."""
        for k, v in counts.items():
            self._excluded[k] = self._excluded.get(k, 0) + v

    def show_lab_progress(self, text: str | None) -> None:
        box = self.query_one("#lab-progress", Static)
        box.update(text or "")
        box.set_class(bool(text), "shown")

"""The block map: the whole pool at a glance, at any size, drawn with Textual's line API.

Each cell is two columns (a glyph and a marker) and stands for a run of `bpc` blocks (blocks per
cell, a power of two: "1 cell = 512 blocks"). At the overview `bpc` is the smallest power of two
that fits the whole pool in `OVERVIEW_ROWS` rows; `+`/`-` zoom around the cursor down to single
blocks, `0` goes back to the whole pool, `j` jumps to the blocks of the last request, `/` shows
one user's blocks at a time.

A cell's colour and letter are those of the user who created most of its non-free blocks; the
letter is UPPER case on the colour while in-use blocks dominate it, lower case when cached ones
do, faint when fewer than half its blocks hold anything, and `·` when all are free. The marker
`+` (on a grey band that spans the cell, so it is plain which cell it belongs to) marks cells
holding blocks the latest request reused; they flash white first.

Only the visible rows are ever summarised (one ranged `summary` call per redraw, never an object
per block), rows become Strips cached by content, and only rows whose cells changed are
refreshed: a 1M-block pool costs what its ~400 visible cells cost.

The map reads a *source*: any object with `num_blocks`, `summary(cells, start, stop, user)`,
`block(block_id)` and optionally `arrays(start, stop)` (tui.backend.ChatBackend has them).
`update_blocks(views, ...)` wraps a plain sequence of block views (the scrubber's) as one.
"""
from __future__ import annotations

import time

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events, work
from textual.binding import Binding
from textual.cache import LRUCache
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip

from kvplay.inert import inert
from kvplay.wire.views import BlockArrays, summarize

from .theme import FREE_STYLE, UNKNOWN_COLOUR

CELL_W = 2
OVERVIEW_ROWS = 12
MAX_ROWS = 18  # the map's tallest (zoomed in, it scrolls)
ZOOM_STEP = 4
SYNC_BLOCKS = 65_536  # pools up to this size are summarised on the UI thread (< 2 ms)
SUMMARY_GAP = 0.25  # bigger pools: a summary (a thread, ~10 ms of numpy) at most 4 times a second
HIT_BG = "#5a5a5a"
HIT_MARK = Style(color="#ffffff", bgcolor=HIT_BG, bold=True)
FLASH = Style(color="#000000", bgcolor="#ffffff", bold=True)
OTHER_STYLE = Style(color="#6a6a6a")
STATE_CODES = ("free", "cached", "in_use")


class ViewsSource:
    """A pool given as a sequence of block views (objects with `state` and `creator`)."""

    def __init__(self, views) -> None:
        self.views = tuple(views)
        users: list[str] = []
        index: dict[str, int] = {}
        state = np.zeros(len(self.views), np.int8)
        creator = np.full(len(self.views), -1, np.int32)
        for i, v in enumerate(self.views):
            state[i] = STATE_CODES.index(v.state) if v.state in STATE_CODES else 0
            if v.creator:
                if v.creator not in index:
                    index[v.creator] = len(users)
                    users.append(v.creator)
                creator[i] = index[v.creator]
        self._state, self._creator, self._users = state, creator, tuple(users)

    @property
    def num_blocks(self) -> int:
        return len(self.views)

    def arrays(self, start: int = 0, stop: int | None = None):
        start, stop, _ = slice(start, stop).indices(len(self.views))
        return BlockArrays(0, start, self._state[start:stop], self._creator[start:stop], self._users)

    def summary(self, cells: int, start: int = 0, stop: int | None = None, user: str | None = None):
        return summarize(self.arrays(start, stop), cells, user)

    def block(self, block_id: int):
        return self.views[block_id] if 0 <= block_id < len(self.views) else None


class BlockMap(ScrollView, can_focus=True):
    """The pool, one cell per run of blocks. Arrows move, +/- zoom, 0 whole pool, j last request, / filter."""

    BINDINGS = [
        Binding("left", "move(-1, 0)", "Cell ←", show=False, id="map.left"),
        Binding("right", "move(1, 0)", "Cell →", show=False, id="map.right"),
        Binding("up", "move(0, -1)", "Cell ↑", show=False, id="map.up"),
        Binding("down", "move(0, 1)", "Cell ↓", show=False, id="map.down"),
        Binding("plus,equals_sign", "zoom(1)", "Zoom in", show=False, id="map.zoom_in", tooltip="Fewer blocks per cell, around the cursor"),
        Binding("minus", "zoom(-1)", "Zoom out", show=False, id="map.zoom_out"),
        Binding("0", "whole_pool", "Whole pool", show=False, id="map.whole"),
        Binding("j", "jump_last", "Last request", show=False, id="map.jump", tooltip="Zoom to the blocks of the last request"),
        Binding("slash", "filter_next", "Filter user", show=False, id="map.filter", tooltip="Show one user's blocks (again: next user)"),
    ]

    cursor: var[int] = var(0)

    class CellSelected(Message):
        """The cursor or the mouse is on a cell: blocks [block_id, block_id + blocks)."""

        def __init__(self, block_id: int, blocks: int = 1, blockmap: "BlockMap | None" = None) -> None:
            super().__init__()
            self.block_id = block_id  # in the map's own numbering (see `BlockMap.offset`)
            self.blocks = blocks
            self.blockmap = blockmap

    class ViewChanged(Message):
        """Scale, zoom, window or filter changed: the scale line should be redrawn."""

        def __init__(self, blockmap: "BlockMap") -> None:
            super().__init__()
            self.blockmap = blockmap

        @property
        def control(self) -> "BlockMap":
            return self.blockmap

    class JumpRequested(ViewChanged):
        """`j`: the app knows the last request's blocks and calls `show_blocks`."""

    def __init__(self, label: str = "Block pool", **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label  # the title line's first words
        self.source = None
        self.looks: dict = {}
        self.hit: frozenset[int] = frozenset()
        self.flash: frozenset[int] = frozenset()
        self.bpc = 1  # blocks per cell now
        self.zoomed = False  # False: bpc follows the overview (the whole pool fits)
        self.user_filter: str | None = None
        self._row_keys: dict[int, tuple] = {}
        self._strips: LRUCache[tuple, Strip] = LRUCache(1024)
        self._scale = ""
        self._base: tuple | None = None  # (window key, base cells) of the last summary
        self._summarising = False  # a summary thread is running (big pools)
        self._summarised_at = 0.0  # when the last one started
        self._summary_due = False  # a timer will ask again
        self.rows_refreshed = 0  # how many row refreshes the last update asked for (tests)
        self.cursor_visible = False  # while focused (or pinned by App.select_block)

    @property
    def offset(self) -> int:
        """The source's block 0 in the app's numbering (a pod's first slot in a fleet; else 0)."""
        return getattr(self.source, "offset", 0)

    def local(self, block_ids) -> frozenset:
        """The app's block ids that this map shows, in its own numbering."""
        off, n = self.offset, self.num_blocks
        return frozenset(b - off for b in block_ids if off <= b < off + n)

    # --- source -------------------------------------------------------------------------------
    def set_source(self, source, looks=None, hit=None, flash=None) -> None:
        self.source = source
        if looks is not None:
            self.looks = looks
        if hit is not None:
            self.hit = frozenset(hit)
        if flash is not None:
            self.flash = frozenset(flash)
        self._rebuild()

    def update_blocks(self, views, looks, hit=frozenset(), flash=frozenset()) -> None:
        """Show a plain sequence of block views (e.g. a recorded pool state)."""
        self.set_source(ViewsSource(views), looks, hit, flash)

    @property
    def views(self) -> tuple:
        return getattr(self.source, "views", ())

    @property
    def num_blocks(self) -> int:
        return self.source.num_blocks if self.source is not None else 0

    # --- geometry -----------------------------------------------------------------------------
    @property
    def cols(self) -> int:
        return max(1, self.scrollable_content_region.width // CELL_W)

    @property
    def overview_bpc(self) -> int:
        n, room = self.num_blocks, self.cols * OVERVIEW_ROWS
        bpc = 1
        while -(-n // bpc) > room:
            bpc *= 2
        return bpc

    @property
    def cell_count(self) -> int:
        return -(-self.num_blocks // self.bpc) if self.num_blocks else 0

    def cell_at(self, x: int, y: int) -> int | None:
        col, row = x // CELL_W, y + int(self.scroll_offset.y)
        if col >= self.cols:
            return None
        i = row * self.cols + col
        return i if 0 <= i < self.cell_count else None

    def cell_blocks(self, cell: int) -> tuple[int, int]:
        """(first block, number of blocks) of a cell at the current scale."""
        first = cell * self.bpc
        return first, max(0, min(self.bpc, self.num_blocks - first))

    def scale_text(self) -> str:
        n = self.num_blocks
        if not n:
            return ""
        unit = "block" if self.bpc == 1 else "blocks"
        out = f"1 cell = {self.bpc:,} {unit} · {n:,} blocks"
        if self.zoomed:
            top = int(self.scroll_offset.y)
            first = top * self.cols * self.bpc
            last = min(n, (top + max(1, self.size.height)) * self.cols * self.bpc) - 1
            out += f" · showing #{first:,}–#{max(first, last):,}"
        else:
            out += " · whole pool"
        if self.user_filter:
            out += f" · only {inert(self.user_filter, limit=64)}'s"
        return out

    # --- summarising the visible window -------------------------------------------------------
    def _base_cells(self, top: int, rows: int) -> list[tuple]:
        """(kind, glyph, colour) of the cells in rows [top, top + rows): one or two ranged
        summaries of the source (thread-safe: reads only the source and plain attributes)."""
        cols, bpc, n, source, user = self.cols, self.bpc, self.num_blocks, self.source, self.user_filter
        start = top * cols * bpc
        stop = min(n, (top + rows) * cols * bpc)
        if stop <= start:
            return []
        full = (stop - start) // bpc
        parts = []
        if full:
            parts.append(source.summary(full, start, start + full * bpc, user))
        if start + full * bpc < stop:
            parts.append(source.summary(1, start + full * bpc, stop, user))
        out = []
        for s in parts:
            users = s.users
            free, cached, in_use = s.free.tolist(), s.cached.tolist(), s.in_use.tolist()
            creators = s.creator.tolist()
            mine = s.mine.tolist() if s.mine is not None else None
            bounds = s.bounds.tolist()
            for k in range(len(free)):
                used = cached[k] + in_use[k]
                if used == 0:
                    out.append(("free", "·", None))
                    continue
                if mine is not None and mine[k] == 0:
                    out.append(("other", "∘", None))
                    continue
                name = user if mine is not None else (users[creators[k]] if 0 <= creators[k] < len(users) else None)
                look = self.looks.get(name) if name else None
                kind = "in_use" if in_use[k] >= cached[k] else "cached"
                if used * 2 < bounds[k + 1] - bounds[k]:
                    kind += "_faint"
                out.append((kind, look.glyph if look else "?", look.colour if look else UNKNOWN_COLOUR))
        return out

    def _window_key(self, top: int, rows: int) -> tuple:
        version = None
        if hasattr(self.source, "version"):
            version = self.source.version
        elif not isinstance(self.source, ViewsSource):
            version = self.source.arrays(0, 0).version
        return (id(self.source), version, self.cols, self.bpc, top, rows, self.user_filter, len(self.looks))

    def _cells_for(self, top: int, rows: int) -> list[tuple] | None:
        """The window's base cells: cached while the pool and the view are unchanged; computed
        here for small pools, on a thread for big ones (None until it lands)."""
        key = self._window_key(top, rows)
        if self._base is not None and self._base[0] == key:
            return self._base[1]
        if self.num_blocks <= SYNC_BLOCKS:
            cells = self._base_cells(top, rows)
            self._base = (key, cells)
            return cells
        stale = self._base
        same_view = stale is not None and stale[0][2:] == key[2:]
        wait = self._summarised_at + SUMMARY_GAP - time.monotonic()
        if same_view and wait > 0:  # a busy server changes the pool every batch: not every frame
            if not self._summary_due:
                self._summary_due = True
                self.set_timer(wait, self._due)
            return stale[1]
        if not self._summarising:
            self._summarising = True
            self._summarised_at = time.monotonic()
            self._summarise(key, top, rows)
        if same_view:  # older pool: show it meanwhile
            return stale[1]
        return None

    def _due(self) -> None:
        self._summary_due = False
        self._rebuild()

    @work(thread=True, exclusive=True, exit_on_error=False, group="blockmap", description="Summarising the pool")
    def _summarise(self, key: tuple, top: int, rows: int) -> None:
        cells = None
        try:
            cells = self._base_cells(top, rows)
        finally:
            try:
                self.app.call_from_thread(self._summarised, key, cells)
            except RuntimeError:  # the app is closing
                pass

    def _summarised(self, key: tuple, cells) -> None:
        self._summarising = False
        if cells is not None:
            self._base = (key, cells)
            self._rebuild()

    def _rebuild(self) -> None:
        if self.source is None:
            return
        if not self.zoomed:
            bpc = self.overview_bpc
            if bpc != self.bpc:
                self.bpc = bpc
                if self.cursor_visible and self.num_blocks:  # the details follow the new scale
                    self.call_after_refresh(self._select)
        cols = self.cols
        total_rows = -(-self.cell_count // cols)
        height = max(1, self.size.height or OVERVIEW_ROWS)
        size = Size(cols * CELL_W, total_rows)
        if size != self.virtual_size:
            self.virtual_size = size
        rows = max(2, min(total_rows, MAX_ROWS))
        if self.styles.height is None or self.styles.height.value != rows:  # the height follows the rows
            self.styles.height = rows
        top = min(int(self.scroll_offset.y), max(0, total_rows - 1))
        base = self._cells_for(top, height)
        if base is None:
            return
        bpc = self.bpc
        hit_cells = {b // bpc for b in self.hit}
        flash_cells = {b // bpc for b in self.flash}
        cursor = self.cursor if self.cursor_visible else -1
        first = top * cols
        cells = [c + (first + i in hit_cells, first + i in flash_cells, first + i == cursor)
                 for i, c in enumerate(base)]
        keys = {top + r: (cols, bpc) + tuple(cells[r * cols:(r + 1) * cols]) for r in range(-(-len(cells) // cols))}
        old, self._row_keys = self._row_keys, keys
        if set(old) != set(keys) or any(k[:2] != (cols, bpc) for k in old.values()):
            self.rows_refreshed = len(keys)
            self.refresh()
        else:
            changed = [r for r, k in keys.items() if old.get(r) != k]
            self.rows_refreshed = len(changed)
            for r in changed:
                self.refresh(Region(0, r - top, self.size.width, 1))
        scale = self.scale_text()
        if scale != self._scale:
            self._scale = scale
            self.post_message(self.ViewChanged(self))

    def on_resize(self, event: events.Resize) -> None:
        self._rebuild()

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        if int(old) != int(new):
            self._rebuild()

    # --- drawing ------------------------------------------------------------------------------
    def _cell_segments(self, key: tuple) -> list[Segment]:
        kind, glyph, colour, hit, flash, cursor = key
        faint = kind.endswith("_faint")
        state = kind.removesuffix("_faint")
        if state == "free":
            cell = Segment("·", FREE_STYLE)
        elif state == "other":
            cell = Segment(glyph, OTHER_STYLE)
        elif state == "in_use":
            cell = Segment(glyph.upper(), Style(color="#000000", bgcolor=colour, bold=True, dim=faint))
        else:
            cell = Segment(glyph.lower(), Style(color=colour, dim=faint))
        if hit:
            cell = Segment(cell.text, cell.style + Style(bgcolor=HIT_BG) if state != "in_use" else cell.style)
        if flash:
            cell = Segment(cell.text, FLASH)
        if cursor:
            cell = Segment(cell.text, cell.style + Style(reverse=True, underline=True))
        mark = Segment("+", HIT_MARK) if hit else Segment(" ")
        return [cell, mark]

    def render_line(self, y: int) -> Strip:
        row = y + int(self.scroll_offset.y)
        width = self.size.width
        key = self._row_keys.get(row)
        if key is None:
            return Strip.blank(width, self.rich_style)
        key = key + (width,)
        strip = self._strips.get(key)
        if strip is None:
            segs: list[Segment] = []
            for cell in key[2:-1]:
                segs += self._cell_segments(cell)
            strip = Strip(segs).apply_style(self.rich_style).extend_cell_length(width, self.rich_style).crop(0, width)
            self._strips[key] = strip
        return strip

    # --- cursor, zoom, filter -----------------------------------------------------------------
    def _select(self) -> None:
        first, count = self.cell_blocks(self.cursor)
        self.post_message(self.CellSelected(first, count, self))

    def watch_cursor(self, cursor: int) -> None:
        if self.num_blocks:
            row = cursor // self.cols
            self.scroll_to_region(Region(0, row, 1, 1), animate=False, immediate=True)
            self._rebuild()
            self._select()

    def action_move(self, dx: int, dy: int) -> None:
        if self.num_blocks:
            self.cursor = max(0, min(self.cell_count - 1, self.cursor + dx + dy * self.cols))

    def set_scale(self, bpc: int, block: int | None = None) -> None:
        """Show `bpc` blocks per cell (1 = single blocks) with the cursor on `block`'s cell."""
        if block is None:
            block = self.cursor * self.bpc
        overview = self.overview_bpc
        self.bpc = max(1, min(bpc, overview))
        self.zoomed = self.bpc < overview
        self.cursor_visible = True
        self._row_keys = {}
        new = min(block // self.bpc, max(0, self.cell_count - 1))
        if new == self.cursor:
            self.watch_cursor(new)
        else:
            self.cursor = new

    def action_zoom(self, step: int) -> None:
        if not self.num_blocks:
            return
        bpc = self.bpc // ZOOM_STEP if step > 0 else self.bpc * ZOOM_STEP
        self.set_scale(max(1, bpc))

    def action_whole_pool(self) -> None:
        self.set_scale(self.overview_bpc)

    def show_blocks(self, block_ids) -> None:
        """Zoom to the smallest scale that shows all of `block_ids`, cursor on the first."""
        ids = sorted(block_ids)
        if not ids:
            return
        room = self.cols * max(1, self.size.height or OVERVIEW_ROWS)
        bpc = 1
        while (ids[-1] // bpc) - (ids[0] // bpc) + 1 > room and bpc < self.overview_bpc:
            bpc *= 2
        self.set_scale(bpc, ids[0])

    def action_jump_last(self) -> None:
        self.post_message(self.JumpRequested(self))

    def action_filter_next(self) -> None:
        names = list(self.looks)
        if not names:
            return
        i = names.index(self.user_filter) + 1 if self.user_filter in names else 0
        self.user_filter = names[i] if i < len(names) else None
        self._row_keys = {}
        self._rebuild()

    # --- keyboard focus, mouse ----------------------------------------------------------------
    def on_mouse_move(self, event: events.MouseMove) -> None:
        i = self.cell_at(event.x, event.y)
        if i is not None:
            first, count = self.cell_blocks(i)
            self.post_message(self.CellSelected(first, count, self))

    def on_click(self, event: events.Click) -> None:
        i = self.cell_at(event.x, event.y)
        if i is not None:
            self.focus()
            self.cursor = i

    def on_focus(self) -> None:
        self.cursor_visible = True
        self._rebuild()
        if self.num_blocks:
            self._select()

    def on_blur(self) -> None:
        self.cursor_visible = False
        self._rebuild()

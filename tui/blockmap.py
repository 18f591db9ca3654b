"""The block map: one cell per pool block, drawn with Textual's line API.

Each cell is two columns: a glyph and a marker. Colour = the user who created the block;
glyph = that user's letter, UPPER case on a coloured background while a running request uses
the block, lower case when it is cached (unreferenced, evictable), `·` when free. The marker
is `+` on blocks the latest request reused (they flash briefly first). Rows are rendered to
Strips cached by content, and only rows whose cells changed are refreshed.
"""
from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.cache import LRUCache
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip

from .theme import FREE_STYLE, UNKNOWN_COLOUR

CELL_W = 2
HIT_MARK = Style(color="#ffffff", bold=True)
FLASH = Style(color="#000000", bgcolor="#ffffff", bold=True)


class BlockMap(ScrollView, can_focus=True):
    """A grid of pool blocks. Move with the arrow keys or the mouse to see a block's details."""

    BINDINGS = [
        Binding("left", "move(-1, 0)", "Block ←", show=False, id="map.left"),
        Binding("right", "move(1, 0)", "Block →", show=False, id="map.right"),
        Binding("up", "move(0, -1)", "Block ↑", show=False, id="map.up"),
        Binding("down", "move(0, 1)", "Block ↓", show=False, id="map.down"),
    ]

    cursor: var[int] = var(0)

    class CellSelected(Message):
        def __init__(self, block_id: int) -> None:
            super().__init__()
            self.block_id = block_id

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.views: tuple = ()
        self.looks: dict = {}
        self.hit: frozenset[int] = frozenset()
        self.flash: frozenset[int] = frozenset()
        self._row_keys: list[tuple] = []
        self._strips: LRUCache[tuple, Strip] = LRUCache(1024)
        self.rows_refreshed = 0  # how many row refreshes the last update asked for (tests)
        self.cursor_visible = False  # while focused (or pinned by App.select_block)

    # --- geometry -----------------------------------------------------------------------------
    @property
    def cell_count(self) -> int:
        return len(self.views)

    @property
    def cols(self) -> int:
        return max(1, self.scrollable_content_region.width // CELL_W)

    def cell_at(self, x: int, y: int) -> int | None:
        col, row = x // CELL_W, y + int(self.scroll_offset.y)
        if col >= self.cols:
            return None
        i = row * self.cols + col
        return i if 0 <= i < len(self.views) else None

    # --- data ---------------------------------------------------------------------------------
    def update_blocks(self, views, looks, hit=frozenset(), flash=frozenset()) -> None:
        self.views, self.looks = tuple(views), looks
        self.hit, self.flash = frozenset(hit), frozenset(flash)
        self._rebuild()

    def _cell_key(self, i: int) -> tuple:
        b = self.views[i]
        look = self.looks.get(b.creator) if b.creator else None
        glyph = look.glyph if look else ("?" if b.creator else "·")
        colour = look.colour if look else UNKNOWN_COLOUR
        return (b.state, glyph, colour, i in self.hit, i in self.flash, i == self.cursor and self.cursor_visible)

    def _rebuild(self) -> None:
        cols = self.cols
        n = len(self.views)
        keys = [(cols,) + tuple(self._cell_key(i) for i in range(r * cols, min(n, (r + 1) * cols)))
                for r in range(-(-n // cols))]
        old, self._row_keys = self._row_keys, keys
        self.virtual_size = Size(cols * CELL_W, len(keys))
        if len(old) != len(keys):
            self.rows_refreshed = len(keys)
            self.refresh()
            return
        changed = [r for r, (a, b) in enumerate(zip(old, keys)) if a != b]
        self.rows_refreshed = len(changed)
        top = int(self.scroll_offset.y)
        for r in changed:
            self.refresh(Region(0, r - top, self.size.width, 1))

    def on_resize(self, event: events.Resize) -> None:
        self._rebuild()

    # --- drawing ------------------------------------------------------------------------------
    def _cell_segments(self, key: tuple) -> list[Segment]:
        state, glyph, colour, hit, flash, cursor = key
        if state == "free":
            cell = Segment("·", FREE_STYLE)
        elif state == "in_use":
            cell = Segment(glyph.upper(), Style(color="#000000", bgcolor=colour, bold=True))
        else:
            cell = Segment(glyph.lower(), Style(color=colour))
        if flash:
            cell = Segment(cell.text, FLASH)
        if cursor:
            cell = Segment(cell.text, cell.style + Style(reverse=True, underline=True))
        mark = Segment("+", HIT_MARK) if hit else Segment(" ")
        return [cell, mark]

    def render_line(self, y: int) -> Strip:
        row = y + int(self.scroll_offset.y)
        width = self.size.width
        if row >= len(self._row_keys):
            return Strip.blank(width, self.rich_style)
        key = self._row_keys[row] + (width,)
        strip = self._strips.get(key)
        if strip is None:
            segs: list[Segment] = []
            for cell in key[1:-1]:
                segs += self._cell_segments(cell)
            strip = Strip(segs).apply_style(self.rich_style).extend_cell_length(width, self.rich_style).crop(0, width)
            self._strips[key] = strip
        return strip

    # --- cursor, keyboard, mouse --------------------------------------------------------------
    def watch_cursor(self, cursor: int) -> None:
        if self.views:
            self._rebuild()
            row = cursor // self.cols
            self.scroll_to_region(Region(0, row, 1, 1), animate=False)
            self.post_message(self.CellSelected(cursor))

    def action_move(self, dx: int, dy: int) -> None:
        if self.views:
            self.cursor = max(0, min(len(self.views) - 1, self.cursor + dx + dy * self.cols))

    def on_mouse_move(self, event: events.MouseMove) -> None:
        i = self.cell_at(event.x, event.y)
        if i is not None:
            self.post_message(self.CellSelected(i))

    def on_click(self, event: events.Click) -> None:
        i = self.cell_at(event.x, event.y)
        if i is not None:
            self.focus()
            self.cursor = i

    def on_focus(self) -> None:
        self.cursor_visible = True
        self._rebuild()
        if self.views:
            self.post_message(self.CellSelected(self.cursor))

    def on_blur(self) -> None:
        self.cursor_visible = False
        self._rebuild()

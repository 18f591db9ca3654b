"""A pane's conversation as one line-API widget (after Toolong's log view): user messages,
streaming replies, badges and notes are entries in a list, each wrapped to the pane's width once
and cached; a streamed token re-wraps only its own entry and repaints the pane. Nothing here asks
the screen for a layout pass (one widget per message did, on every token, and the whole screen
reflowed: keystrokes waited behind it while users streamed)."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

KINDS = ("hint", "user", "reply", "badge", "note", "error")
GAP_BEFORE = frozenset({"hint", "user", "note", "error"})  # a blank line above these


@dataclass
class Entry:
    kind: str
    text: Text
    width: int = -1  # the width `lines` were wrapped for
    first: bool = False  # ... and whether it was the first entry (no blank line above it)
    lines: list[Strip] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)


class ChatLog(ScrollView, can_focus=False):
    """Entries top to bottom; follows the newest line unless the user scrolled up to read."""

    COMPONENT_CLASSES = {f"chatlog--{k}" for k in KINDS}
    DEFAULT_CSS = """
    ChatLog { height: 1fr; overflow-x: hidden; overflow-y: auto; scrollbar-gutter: stable;
              scrollbar-size-vertical: 1; }
    ChatLog > .chatlog--hint { color: $text-muted; text-style: italic; }
    ChatLog > .chatlog--user { }
    ChatLog > .chatlog--reply { color: $text; }
    ChatLog > .chatlog--badge { color: $text-muted; }
    ChatLog > .chatlog--note { color: $warning; }
    ChatLog > .chatlog--error { color: $error; }
    """
    FOLLOW_SLACK = 3  # lines from the bottom that still count as "at the end"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entries: list[Entry] = []
        self._starts: list[int] = []  # first line of each entry
        self._total = 0
        self._width = 0  # the content width (set on resize: the gutter is stable)
        self._styles: dict[str, object] = {}  # rich style per kind, and "" for the widget's own
        self._line_cache: dict[int, Strip] = {}  # drawn lines by absolute line number

    # --- content ------------------------------------------------------------------------------
    def add(self, kind: str, text: Text | str) -> Entry:
        """Append an entry; returns it (to `set` or `remove` later)."""
        assert kind in KINDS, kind
        follow = self._at_end()
        self.entries.append(Entry(kind, _text(text)))
        self._starts.append(self._total)
        self._total += self._height(len(self.entries) - 1)
        self._changed(follow)
        return self.entries[-1]

    def set(self, entry: Entry, text: Text | str) -> None:
        """Replace an entry's text (a streamed reply grows this way)."""
        index = self._index(entry)
        if index is None:
            return
        follow = self._at_end()
        entry.text, entry.width = _text(text), -1
        self._forget_lines(self._starts[index])
        before = self._height_cached(index)
        delta = self._height(index) - before
        if delta:
            for j in range(index + 1, len(self._starts)):
                self._starts[j] += delta
            self._total += delta
        self._changed(follow)

    def remove(self, *entries: Entry) -> None:
        """Drop entries (a failed reply's body and badge)."""
        gone = {id(e) for e in entries}
        self.entries = [e for e in self.entries if id(e) not in gone]
        self._reflow()

    def _index(self, entry: Entry) -> int | None:
        """Where an entry is now: searched from the end, where streaming happens."""
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i] is entry:
                return i
        return None

    def remove_kind(self, kind: str) -> None:
        keep = [e for e in self.entries if e.kind != kind]
        if len(keep) != len(self.entries):
            self.entries = keep
            self._reflow()

    def texts(self, kind: str | None = None) -> list[str]:
        """The plain text of each entry (of one kind), top to bottom."""
        return [e.text.plain for e in self.entries if kind is None or e.kind == kind]

    # --- geometry -----------------------------------------------------------------------------
    def _wrap_width(self) -> int:
        return max(1, self._width)

    def _wrap(self, e: Entry, first: bool) -> None:
        width = self._wrap_width()
        if e.width == width and e.first == first:
            return
        e.width, e.first = width, first
        e.lines, e.plain = [], []
        if not e.text.plain:
            return
        console = self.app.console
        own = self._style("")
        t = e.text.copy()
        t.stylize_before(self._style(e.kind))
        if e.kind in GAP_BEFORE and not first:
            e.lines.append(Strip.blank(width, own))
            e.plain.append("")
        for line in t.wrap(console, width, overflow="fold"):
            line.rstrip_end(width)
            e.lines.append(Strip(line.render(console), line.cell_len).extend_cell_length(width, own))
            e.plain.append(line.plain)

    def _style(self, kind: str):
        """The widget's rich style ("") or a kind's on top of it, computed once per theme."""
        if kind not in self._styles:
            own = self.rich_style
            # the full component style: $text-muted and friends are blends that need the background
            self._styles[kind] = own if not kind else own + self.get_component_rich_style(f"chatlog--{kind}")
        return self._styles[kind]

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = {}
        for e in getattr(self, "entries", ()):
            e.width = -1
        if getattr(self, "_line_cache", None):
            self._line_cache.clear()

    def _height(self, index: int) -> int:
        e = self.entries[index]
        if not self.is_mounted or self._width <= 0:
            e.width = -1
            return 0
        self._wrap(e, index == 0)
        return len(e.lines)

    def _height_cached(self, index: int) -> int:
        nxt = self._starts[index + 1] if index + 1 < len(self._starts) else self._total
        return nxt - self._starts[index]

    def _forget_lines(self, first: int) -> None:
        if first == 0:
            self._line_cache.clear()
        else:
            for y in [y for y in self._line_cache if y >= first]:
                del self._line_cache[y]

    def _reflow(self) -> None:
        """Every entry's place again (a resize, a removal)."""
        self._line_cache.clear()
        follow = self._at_end()
        self._starts, total = [], 0
        for i in range(len(self.entries)):
            self._starts.append(total)
            total += self._height(i)
        self._total = total
        self._changed(follow)

    def _at_end(self) -> bool:
        return self.max_scroll_y - self.scroll_y <= self.FOLLOW_SLACK

    def _changed(self, follow: bool) -> None:
        """The virtual height changed (or not): tell the scrollbars, repaint, follow the end.
        A screen layout only when the scrollbar appears or goes."""
        size = Size(self._wrap_width(), self._total)
        if size != self.virtual_size:
            shown = self.show_vertical_scrollbar
            self.set_reactive(Widget.virtual_size, size)
            self._scroll_update(size)
            if self.show_vertical_scrollbar != shown:
                self.refresh(layout=True)
        if follow and self.max_scroll_y != self.scroll_y:
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)
        self.refresh()

    def on_resize(self) -> None:
        width = self.scrollable_content_region.width
        if width != self._width:
            self._width = width
            self._reflow()

    def on_mount(self) -> None:
        self._width = self.scrollable_content_region.width
        self._reflow()

    # --- drawing ------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        line = self.scroll_offset.y + y
        selection = self.text_selection
        if selection is None and line in self._line_cache:
            return self._line_cache[line]
        width, own = self._wrap_width(), self._style("")
        if not self.entries or line >= self._total or line < 0:
            return Strip.blank(width, own)
        i = bisect_right(self._starts, line) - 1
        e = self.entries[i]
        self._wrap(e, i == 0)
        local = line - self._starts[i]
        if local >= len(e.lines):  # wrapped for another width a moment ago: redrawn after the reflow
            return Strip.blank(width, own)
        strip = e.lines[local]
        if selection is not None and (span := selection.get_span(line)) is not None:
            start, end = span
            end = len(e.plain[local]) if end == -1 else end
            t = Text(e.plain[local], style=own)
            t.stylize(self.screen.get_component_rich_style("screen--selection"), start, end)
            return Strip(t.render(self.app.console), t.cell_len).crop_extend(0, width, own).apply_offsets(0, line)
        strip = strip.apply_offsets(0, line)
        if selection is None:
            if len(self._line_cache) > 1024:  # a long scroll back: start again
                self._line_cache.clear()
            self._line_cache[line] = strip
        return strip

    def get_selection(self, selection) -> tuple[str, str] | None:
        lines = []
        for i, e in enumerate(self.entries):
            self._wrap(e, i == 0)
            lines.extend(e.plain)
        return selection.extract("\n".join(lines)), "\n"

    def selection_updated(self, selection) -> None:
        self._line_cache.clear()
        self.refresh()


def _text(text: Text | str) -> Text:
    return text if isinstance(text, Text) else Text(text)


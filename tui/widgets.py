"""Small widgets of the playground that draw to their own size: the request bars, a footer that
fits a small terminal, and the pane switcher shown when only one pane fits; and `InertNotify`,
the apps' notifications as inert text."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget
from textual.widgets import Footer, Static, Tab, Tabs
from textual.widgets._footer import FooterKey

from kvplay.inert import inert

from .format import requests_text, ttft_text

CACHE_TAB = "tab-cache"


def update_static(w: Static, content) -> None:
    """`Static.update` that asks the screen for a layout pass only when the new content is not as
    tall as the old: a layout reflows every widget on the screen, and the counters change 15 times
    a second while users stream (each pass took ~13 ms and keystrokes queued behind them)."""
    w.update(content, layout=False)
    width = w.content_size.width
    if not width:  # not laid out yet: the layout pass sizes it
        w._kv_height = None
        w.refresh(layout=True)
    else:
        refresh_if_taller(w, w.visual.get_height(w.styles, width))


class InertNotify:
    """An App mixin: every notification (toast) shows its message and title inert
    (kvplay/inert.py), never parsed as markup: they quote names, errors and servers' words."""

    def notify(self, message: str, *, title: str = "", severity="information", timeout: float | None = None,
               markup: bool = False) -> None:
        super().notify(inert(message, lines=True, limit=2048), title=inert(title, limit=256), severity=severity,
                       timeout=timeout, markup=False)


def refresh_if_taller(w: Widget, height: int) -> None:
    """Repaint `w`; a layout pass as well only when its height is not what it was."""
    if height != getattr(w, "_kv_height", None):
        w._kv_height = height
        w.refresh(layout=True)
    else:
        w.refresh()


class RequestBars(Widget):
    """One bar per recent request (and the TTFT sparklines), as wide as the panel is now:
    re-rendered on every resize, so 200→80→200 columns gives wide bars again."""

    DEFAULT_CSS = "RequestBars { height: auto; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.requests: list = []
        self.ttft: dict[str, list[float]] = {}
        self.looks: dict = {}
        self.timings = True

    def show(self, requests: list, ttft: dict, looks: dict, timings: bool) -> None:
        self.requests, self.ttft, self.looks, self.timings = requests, ttft, looks, timings
        t = self.render()
        refresh_if_taller(self, t.plain.count("\n") + 1 if t.plain else 0)

    def render(self) -> Text:
        width = max(8, self.size.width - 12)
        t = requests_text(self.requests, self.looks, width)
        if self.timings and self.ttft:
            if t:
                t.append("\n")
            t.append_text(ttft_text(self.ttft, self.looks, max(8, min(40, self.size.width - 14))))
        return t


class KvFooter(Footer):
    """Textual's footer; in a small terminal only the keys in `keep` (by action), so it is never
    cut mid-key. Every other action stays on its key and in the command palette (ctrl+p)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.keep: set[str] | None = None

    def set_keep(self, keep: set[str] | None) -> None:
        if keep != self.keep:
            self.keep = keep
            self.call_later(self.recompose)

    def compose(self):
        kept = 0
        for w in super().compose():
            if self.keep is not None and isinstance(w, FooterKey) and not w.has_class("-command-palette") \
                    and w.action not in self.keep:
                continue
            kept += 1
            yield w
        self.styles.grid_size_columns = max(1, kept)


class PaneSwitcher(Tabs):
    """One tab per user and one for the cache panel (small terminals show one at a time)."""

    def __init__(self, users: list[tuple[str, str]], **kwargs) -> None:
        tabs = [Tab(label, id=tab_id) for tab_id, label in users] + [Tab("▦ cache", id=CACHE_TAB)]
        super().__init__(*tabs, **kwargs)

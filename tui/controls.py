"""The controls room: what the keys and the command palette do (focus, modes, cache, users,
prompt, labs, screenshot).

Every control that changes the backend's engine asks the backend's `Controls`
(kvplay.wire.chat_backend) first: what the backend does not support is one notice saying how
to change it where it is decided, and the palette lists only what it supports. Backend calls that
wait on the engine thread (reconfigure, clear) run in thread workers.
"""
from __future__ import annotations

import importlib
import time
from pathlib import Path

from textual import work
from textual.app import SystemCommand
from textual.widgets import Log, Static, Tab

from kvplay.engine.config import EVICTION_POLICIES, ISOLATION_MODES
from kvplay.engine.errors import EngineError
from kvplay.sessions.script import UserSpec

from .blockmap import BlockMap
from .panes import ChatPane
from .screens import ConfirmScreen, FormScreen, HelpScreen, LabScreen, TextScreen

# Labs from the palette run on the app's own engine, sized to finish in a minute or two here
# (the CLI's defaults measure more).
APP_LABS = {
    "determinism": ("kvplay.labs.determinism", "DeterminismParams", {}),
    "leak": ("kvplay.labs.leak", "LeakParams", {"blocks": [1, 4], "samples": 8, "repeats": 1, "mitigations": []}),
    "collide": ("kvplay.labs.collide", "CollideParams", {"feed": 120, "offline": 5000}),
    "response-cache": ("kvplay.labs.response_cache", "ResponseCacheParams", {}),
}
from .theme import assign_looks
from .widgets import CACHE_TAB

# Counters a lab's own requests add to the engine's; the app subtracts them (without_labs).
LAB_COUNTERS = ("query_tokens", "hit_tokens", "evictions", "preemptions", "collisions_caught", "requests_finished")


# keys that change the backend's engine: action -> control (kvplay.wire.chat_backend.CONTROLS)
ACTION_CONTROLS = {"cycle_isolation": "isolation", "cycle_eviction": "eviction",
                   "toggle_deterministic": "deterministic", "clear_cache": "clear"}
# palette entries that change the backend's engine: by category, or by title
PALETTE_CONTROLS = {"isolation": "isolation", "eviction": "eviction", "lab": "labs",
                    "cache: clear": "clear", "mode: toggle deterministic": "deterministic"}


def palette_control(title: str) -> str | None:
    """The control (kvplay.wire.chat_backend.CONTROLS) a palette entry changes, or None."""
    return PALETTE_CONTROLS.get(title) or PALETTE_CONTROLS.get(title.split(":")[0])

APP_LAB_TITLE = "from the app"  # a lab session recorded by the app (its sizes are APP_LABS')


def last_lab_seconds(db_path: str | None, name: str, model: str) -> float | None:
    """How long the last run of lab `name` from the app on `model` took (its recorded session),
    or None: the estimate shown before a lab starts."""
    # start-up time: imported when this first runs
    from kvplay.sessions.store import open_db

    try:
        db = open_db(db_path, create=False)
    except EngineError:
        return None
    try:
        row = db.execute("select created, ended from sessions where source = ? and title = ? and model = ? "
                         "and ended is not null order by id desc limit 1",
                         [f"lab:{name}", APP_LAB_TITLE, model]).fetchone()
    except Exception:
        return None
    finally:
        db.close()
    return None if row is None else max(0.0, row[1] - row[0])


class LabProgress:
    """A lab's progress (LabContext calls phase/advance on the lab's thread) shown in the app:
    the phase, steps done / total, time so far and the phase's time left at its pace."""

    def __init__(self, app, lab: str) -> None:
        self.app, self.lab = app, lab
        self.t0 = time.monotonic()
        self.label, self.total, self.done, self.phase_t0, self._shown = "", 1, 0, self.t0, 0.0

    def phase(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.phase_t0 = label, max(1, total), 0, time.monotonic()
        self._show()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.done >= self.total or time.monotonic() - self._shown > 0.25:
            self._show()

    def close(self) -> None:
        """The lab is done (the app hides the line once it has cleaned up)."""

    def text(self) -> str:
        now = time.monotonic()
        line = f"lab {self.lab}: {self.label} {min(self.done, self.total)}/{self.total} · {now - self.t0:.0f} s"
        if 0 < self.done < self.total:
            left = (now - self.phase_t0) / self.done * (self.total - self.done)
            line += f" · this step ~{left:.0f} s more"
        return line

    def _show(self) -> None:
        self._shown = time.monotonic()
        self.app.call_from_thread(self.app.show_lab_progress, self.text())


def screenshot_dir() -> Path:
    """Where ctrl+s saves: `<XDG data dir>/kvplay/screenshots` (next to the sessions DB's
    default place), whatever the current directory is."""
    # start-up time: imported when this first runs (as sessions/store.py does)
    from platformdirs import user_data_dir

    return Path(user_data_dir("kvplay", appauthor=False)) / "screenshots"


def without_labs(stats: dict, excluded: dict[str, int]) -> dict:
    """The engine's stats minus what labs run from the app added: the app's numbers describe
    the app's own requests (as its request bars and its recorded session do)."""
    if not excluded:
        return stats
    out = dict(stats)
    for k, v in excluded.items():
        if k in out:
            out[k] = max(0, out[k] - v)
    out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out.get("query_tokens") else 0.0
    return out


class ControlsRoom:
    """Actions bound in KvplayApp.BINDINGS and listed in the command palette (a part of
    KvplayApp: it reads the app's backend, panes and recorder)."""

    def allowed(self, control: str) -> bool:
        """Whether the backend lets the app change `control` now; if not, one notice says why."""
        if self.backend is None:
            self.notify("The model is still loading.", severity="warning")
            return False
        controls = self.backend.controls
        if not controls.supports(control):
            self.notify(controls.refusal(control), severity="warning", timeout=10)
            return False
        return True

    def offers(self, action: str) -> bool:
        """Whether the footer shows the key of `action`: not a control the backend lacks."""
        control = ACTION_CONTROLS.get(action)
        return control is None or self.backend is None or self.backend.controls.supports(control)

    def setting(self, name: str):
        """An engine setting as the backend has it now (before it is ready: the app's config)."""
        value = self.backend.setting(name) if self.backend is not None else None
        return getattr(self.config, name) if value is None else value

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
        self.query_one(BlockMap).focus()

    def action_toggle_events(self) -> None:
        self.show_events(not self.query_one("#events", Log).has_class("shown"))

    def _reconfigure(self, **changes) -> None:
        if not self.allowed(next(iter(changes))):
            return
        what = ", ".join(f"{k} {('on' if v else 'off') if isinstance(v, bool) else v}" for k, v in changes.items())

        def apply(ok: bool | None = True) -> None:
            if ok:
                self._apply_reconfigure(changes, what)

        n = self.backend.fresh_cache_blocks(**changes)
        if n:  # what clearing drops: the cached blocks (a running request's finish first)
            self.push_screen(ConfirmScreen(f"Switching to {what} needs a fresh cache: the {n} cached "
                                           f"block{'s' if n != 1 else ''} in the pool will be dropped. Continue?"),
                             apply)
        else:
            apply(True)

    @work(thread=True, exit_on_error=False, group="control", description="Reconfiguring")
    def _apply_reconfigure(self, changes: dict, what: str) -> None:
        try:
            self.backend.reconfigure(**changes)
        except EngineError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error")
            return
        self._dirty = True
        self.call_from_thread(self.notify, f"Now {what}.", title="Mode")

    def set_isolation(self, mode: str) -> None:
        self._reconfigure(isolation=mode)

    def set_eviction(self, policy: str) -> None:
        self._reconfigure(eviction=policy)

    def action_cycle_isolation(self) -> None:
        cur = self.setting("isolation")
        self.set_isolation(ISOLATION_MODES[(ISOLATION_MODES.index(cur) + 1) % len(ISOLATION_MODES)])

    def action_cycle_eviction(self) -> None:
        cur = self.setting("eviction")
        self.set_eviction(EVICTION_POLICIES[(EVICTION_POLICIES.index(cur) + 1) % len(EVICTION_POLICIES)])

    def action_toggle_deterministic(self) -> None:
        self._reconfigure(deterministic=not self.setting("deterministic"))

    def action_clear_cache(self) -> None:
        if self.allowed("clear"):
            self._clear_cache()

    @work(thread=True, exit_on_error=False, group="control", description="Clearing the cache")
    def _clear_cache(self) -> None:
        try:
            n = self.backend.clear_cache()
        except EngineError as exc:  # a server that refuses (or lacks) the reset
            self.call_from_thread(self.notify, str(exc), severity="error", timeout=10)
            return
        self._dirty = True
        self.call_from_thread(self.notify, f"Cache cleared ({n} blocks dropped)." if isinstance(n, int)
                              else "Cache cleared.")

    def action_edit_system(self) -> None:
        def done(text: str | None) -> None:
            if text is not None and text.strip() and text != self.system_prompt:
                self.system_prompt = text
                self.notify("New system prompt: the next turns start a new shared prefix.")

        self.push_screen(TextScreen("Shared system prompt (every user's prompt starts with it)",
                                    self.system_prompt), done)

    def set_user_group(self, pane, group: str | None) -> None:
        """Move the pane's user to `group`: the engine's registry decides (recorded as
        UserGroupChanged, applied from the user's next request); the users table keeps the
        latest settings."""
        pane.spec.group = group
        if self.backend is not None and self.backend.controls.groups:
            self.backend.set_group(pane.spec.name, group)
        pane.refresh_subtitle()
        self.recording.add_user(pane.spec, self.looks[pane.spec.name].colour)

    def action_user_settings(self) -> None:
        pane = self.current_pane()
        s = pane.spec

        def done(values: dict | None) -> None:
            if values is None:
                return
            try:
                seed = int(values["seed"])
                temp = float(values["temperature"])
                max_tokens = int(values["max_tokens"])
                if temp < 0 or max_tokens < 1:
                    raise ValueError
            except ValueError:
                self.notify("Seed and max tokens must be whole numbers (max tokens ≥ 1), temperature ≥ 0.",
                            severity="error")
                return
            s.seed, s.temperature, s.max_tokens = seed, temp, max_tokens
            group = values["group"].strip() or None
            if group != s.group and not self.allowed("groups"):
                group = s.group  # the backend binds groups itself: the rest still applies
            self.set_user_group(pane, group)  # records the user too
            self.notify(f"{s.name}: seed {seed}, temperature {temp:g}, group {s.group or '-'}")

        self.push_screen(FormScreen(f"Settings for {s.name}", [
            ("seed", "seed (same seed + same prompt = same reply)", str(s.seed)),
            ("temperature", "temperature (0 = greedy)", f"{s.temperature:g}"),
            ("max_tokens", "max tokens per reply", str(s.max_tokens)),
            ("group", "group (for isolation = group)", s.group or ""),
        ]), done)

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
        self.users.append(spec)
        self.looks = assign_looks([u.name for u in self.users], {spec.name: spec.colour}, self.looks)
        pane = ChatPane(spec, self.looks[spec.name], self._hint(len(self.panes), spec.name))
        self._panes[spec.name] = pane
        self.query_one("#panes").mount(pane)
        self.query_one("#switcher").add_tab(Tab(f"{self.looks[spec.name].glyph} {spec.name}",
                                                id=self._tab_id(spec.name)), before=CACHE_TAB)
        self._layout_panes()
        self._update_legend()
        if self.backend is not None:
            try:
                self.backend.register_user(spec.name, spec.group)
            except EngineError:  # a removed pane's user comes back in another group (local engine)
                self.backend.set_group(spec.name, spec.group)
            pane.call_after_refresh(pane.set_ready, True)
        if self.record:
            self.recording.add_user(spec, self.looks[spec.name].colour)
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
                self.users = [u for u in self.users if u.name != pane.user]
                self._panes.pop(pane.user, None)
                pane.remove()
                self.query_one("#switcher").remove_tab(self._tab_id(pane.user))
                self.call_after_refresh(self._layout_panes)
                self.notify(f"Removed {pane.user} (their blocks stay in the pool until evicted).")

        self.push_screen(ConfirmScreen(f"Remove {pane.user}'s pane?"), done)

    def action_run_lab(self, name: str) -> None:
        if not self.allowed("labs"):
            return

        def done(ok: bool | None) -> None:
            if ok:
                self.notify(f"Running the {name} lab… watch the block map; its progress shows above it and "
                            "its verdict opens here when done.", title="Lab", timeout=8)
                self._run_lab(name)

        where = (f"They are recorded as a session of their own (lab:{name}), not in this one." if self.record
                 else "They are not recorded (--no-record).")
        last = last_lab_seconds(self.db, name, self.backend.model_name) if self.record else None
        took = (f"Its last run from the app on this model took {last:.0f} s." if last is not None
                else "Its progress (steps done / total) shows at the top of the cache panel.")
        self.push_screen(ConfirmScreen(
            f"The {name} lab runs on this engine: it clears the cache and switches modes while it runs "
            "(restoring them after), and empties the cache when done; its requests do not count in "
            f"the app's numbers. {where} {took} Typing meanwhile disturbs its measurements. Run it?"), done)

    @work(thread=True, exclusive=True, exit_on_error=False, group="lab", description="Running a lab")
    def _run_lab(self, name: str) -> None:
        # start-up time: imported when this first runs
        from kvplay.labs.common import LabContext, renderables

        module, params_cls, sizes = APP_LABS[name]
        mod = importlib.import_module(module)
        before = self.engine.stats(timeout=60)
        self.recording.pause(True)  # the app's session keeps the app's requests only
        rec = None
        progress = LabProgress(self, name)
        try:
            if self.record:
                try:
                    rec = self._lab_recorder(name)
                except EngineError as exc:  # the lab still runs, unrecorded
                    self.call_from_thread(self.notify, f"The {name} lab is not recorded: {exc}", severity="warning")
            result = mod.run(self.engine, getattr(mod, params_cls)(**sizes), LabContext(progress, rec))
        except Exception as exc:  # a lab failure is a notice, never a crash of the app
            self.call_from_thread(self.notify, f"{name} lab failed: {exc}", severity="error")
            return
        finally:
            # The lab leaves nothing behind: its blocks go (it cleared the app's at its start),
            # and its requests leave the app's counters. The app's session sees one clear.
            if rec is not None:
                try:
                    rec.close()
                except Exception as exc:
                    self.call_from_thread(self.notify, f"The {name} lab's session: {exc}", severity="warning")
            self.recording.pause(False)
            self.engine.clear_cache()
            after = self.engine.stats(timeout=60)
            for k in LAB_COUNTERS:
                self._excluded[k] = self._excluded.get(k, 0) + after.get(k, 0) - before.get(k, 0)
            self._dirty = True
            self.call_from_thread(self.show_lab_progress, None)
        parts = renderables(result)  # tables..., verdict, footer: show the verdict first
        title = f"lab: {name}" + (f"  (recorded as session {rec.session_id})" if rec is not None else "")
        self.call_from_thread(self.push_screen, LabScreen(title, [parts[-2], *parts[:-2], parts[-1]]))

    def _lab_recorder(self, name: str):
        """The lab's own session (source lab:NAME, title APP_LAB_TITLE), attached to the engine."""
        # start-up time: imported when this first runs
        from kvplay.sessions.recorder import Recorder

        rec = Recorder.open(self.db, self.engine.config, self.backend.model_name, source=f"lab:{name}",
                            system_prompt="", title=APP_LAB_TITLE)
        rec.attach(self.engine)
        return rec

    def show_lab_progress(self, text: str | None) -> None:
        box = self.query_one("#lab-progress", Static)
        box.update(text or "")
        box.set_class(bool(text), "shown")

    def action_screenshot(self) -> None:
        folder = screenshot_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)  # our own data dir, never the cwd
            path = self.save_screenshot(path=str(folder))
        except OSError as exc:
            self.notify(f"Could not save the screenshot in {folder}: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"Saved {path}", title="Screenshot", timeout=8)

    # --- command palette: "category: action" ---------------------------------------------------
    def get_system_commands(self, screen):
        cmds = [
            ("pane: focus next", "Move to the next user's pane", lambda: self.action_focus_pane(1)),
            ("pane: focus previous", "Move to the previous user's pane", lambda: self.action_focus_pane(-1)),
            ("user: add", "Add a user with a new pane", self.action_add_user),
            ("user: remove", "Remove the current user's pane", self.action_remove_user),
            ("user: settings", "Seed, temperature, max tokens, group of the current user", self.action_user_settings),
            ("cache: clear", "Drop every cached block", self.action_clear_cache),
            ("mode: toggle deterministic", "Bitwise-identical results cached or not (empties the cache)",
             self.action_toggle_deterministic),
            ("prompt: edit system prompt", "Change the shared system prompt", self.action_edit_system),
            ("view: toggle event log", "Show or hide the engine's event log", self.action_toggle_events),
            ("view: block map", "Focus the block map (arrows move, details below it)", self.action_focus_map),
            ("app: save screenshot", "Save an SVG of the screen in kvplay's data folder (screenshots/)", self.action_screenshot),
            ("lab: determinism", "Cached vs cold vs batched logits, default and deterministic mode",
             lambda: self.action_run_lab("determinism")),
            ("lab: leak", "Can another user tell a cache hit from their TTFT? (ROC AUC)",
             lambda: self.action_run_lab("leak")),
            ("lab: collide", "Hash collisions with a truncated hash, verify-on-hit off and on",
             lambda: self.action_run_lab("collide")),
            ("lab: response-cache", "A response cache vs the KV prefix cache: 'Am I pretty?'",
             lambda: self.action_run_lab("response-cache")),
            ("app: help", "What the colours, glyphs and numbers mean", self.action_help),
            ("app: quit", "Quit kvplay", self.action_quit),
        ]
        for mode in ISOLATION_MODES:
            cmds.append((f"isolation: {mode}", f"Set block sharing to {mode}", lambda m=mode: self.set_isolation(m)))
        for pol in EVICTION_POLICIES:
            cmds.append((f"eviction: {pol}", f"Evict cached blocks {pol} first", lambda p=pol: self.set_eviction(p)))
        controls = self.backend.controls if self.backend is not None else None  # (all, while loading)
        if controls is not None:  # the palette lists what this backend supports
            cmds = [c for c in cmds if (name := palette_control(c[0])) is None or controls.supports(name)]
        if self.turns:
            cmds += [("replay: pause or resume", "Pause or resume the script", self.action_replay_pause),
                     ("replay: step", "Play the next turn", self.action_replay_step)]
        for title, help_, cb in cmds:
            yield SystemCommand(title, help_, cb)
        for c in super().get_system_commands(screen):
            if c.title.lower() not in ("quit", "screenshot"):
                yield c

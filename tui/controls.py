"""The controls room: what the keys and the command palette change in the backend's engine
(isolation, eviction, deterministic mode, clearing the cache, labs).

`ControlsRoom` holds the backend's `Controls` (kvplay.wire.chat_backend) and asks them first:
what the backend does not support is one notice saying how to change it where it is decided,
and the palette lists only what it supports. Backend calls that wait on the engine thread
(reconfigure, clear, a lab) run in thread workers of the app.
"""
from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Callable

from platformdirs import user_data_dir

from kvplay.engine.config import EVICTION_POLICIES, ISOLATION_MODES, EngineConfig
from kvplay.engine.errors import EngineError
from kvplay.labs.common import LabContext, renderables
from kvplay.sessions.recorder import Recorder
from kvplay.sessions.store import open_db

from .recording_room import RecordingRoom
from .screens import ConfirmScreen, LabScreen

# Labs from the palette run on the app's own engine, sized to finish in a minute or two here
# (the CLI's defaults measure more).
APP_LABS = {
    "determinism": ("kvplay.labs.determinism", "DeterminismParams", {}),
    "leak": ("kvplay.labs.leak", "LeakParams", {"blocks": [1, 4], "samples": 8, "repeats": 1, "mitigations": []}),
    "collide": ("kvplay.labs.collide", "CollideParams", {"feed": 120, "offline": 5000}),
    "response-cache": ("kvplay.labs.response_cache", "ResponseCacheParams", {}),
}
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

    def __init__(self, ui, show: Callable[[str | None], None], lab: str) -> None:
        self.ui, self.show, self.lab = ui, show, lab
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
        self.ui.call_from_thread(self.show, self.text())


def screenshot_dir() -> Path:
    """Where ctrl+s saves: `<XDG data dir>/kvplay/screenshots` (next to the sessions DB's
    default place), whatever the current directory is."""
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
    """What the keys and the palette change in the backend's engine. Holds the backend (once
    ready) and its `Controls`; talks to the UI through `ui` (an App: notices, dialogs, workers)
    and to the cache views through `cache` (`mark_dirty`, `exclude`, `show_lab_progress`)."""

    def __init__(self, ui, config: EngineConfig, recording: RecordingRoom, cache, record: bool = True) -> None:
        self.ui, self.config, self.recording, self.cache, self.record = ui, config, recording, cache, record
        self.backend = None  # the ChatBackend, once the app has one

    def bind(self, backend) -> None:
        self.backend = backend

    @property
    def controls(self):
        """The backend's Controls (None while the model loads)."""
        return self.backend.controls if self.backend is not None else None

    def allowed(self, control: str) -> bool:
        """Whether the backend lets the app change `control` now; if not, one notice says why."""
        if self.backend is None:
            self.ui.notify("The model is still loading.", severity="warning")
            return False
        controls = self.backend.controls
        if not controls.supports(control):
            self.ui.notify(controls.refusal(control), severity="warning", timeout=10)
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

    # --- modes and the cache ----------------------------------------------------------------
    def reconfigure(self, **changes) -> None:
        if not self.allowed(next(iter(changes))):
            return
        what = ", ".join(f"{k} {('on' if v else 'off') if isinstance(v, bool) else v}" for k, v in changes.items())

        def apply(ok: bool | None = True) -> None:
            if ok:
                self.ui.run_worker(lambda: self._apply_reconfigure(changes, what), thread=True,
                                   exit_on_error=False, group="control", description="Reconfiguring")

        n = self.backend.fresh_cache_blocks(**changes)
        if n:  # what clearing drops: the cached blocks (a running request's finish first)
            self.ui.push_screen(ConfirmScreen(f"Switching to {what} needs a fresh cache: the {n} cached "
                                              f"block{'s' if n != 1 else ''} in the pool will be dropped. Continue?"),
                                apply)
        else:
            apply(True)

    def _apply_reconfigure(self, changes: dict, what: str) -> None:
        try:
            self.backend.reconfigure(**changes)
        except EngineError as exc:
            self.ui.call_from_thread(self.ui.notify, str(exc), severity="error")
            return
        self.cache.mark_dirty()
        self.ui.call_from_thread(self.ui.notify, f"Now {what}.", title="Mode")

    def set_isolation(self, mode: str) -> None:
        self.reconfigure(isolation=mode)

    def set_eviction(self, policy: str) -> None:
        self.reconfigure(eviction=policy)

    def cycle_isolation(self) -> None:
        cur = self.setting("isolation")
        self.set_isolation(ISOLATION_MODES[(ISOLATION_MODES.index(cur) + 1) % len(ISOLATION_MODES)])

    def cycle_eviction(self) -> None:
        cur = self.setting("eviction")
        self.set_eviction(EVICTION_POLICIES[(EVICTION_POLICIES.index(cur) + 1) % len(EVICTION_POLICIES)])

    def toggle_deterministic(self) -> None:
        self.reconfigure(deterministic=not self.setting("deterministic"))

    def clear_cache(self) -> None:
        if self.allowed("clear"):
            self.ui.run_worker(self._clear_cache, thread=True, exit_on_error=False, group="control",
                               description="Clearing the cache")

    def _clear_cache(self) -> None:
        try:
            n = self.backend.clear_cache()
        except EngineError as exc:  # a server that refuses (or lacks) the reset
            self.ui.call_from_thread(self.ui.notify, str(exc), severity="error", timeout=10)
            return
        self.cache.mark_dirty()
        self.ui.call_from_thread(self.ui.notify, f"Cache cleared ({n} blocks dropped)." if isinstance(n, int)
                                 else "Cache cleared.")

    # --- labs on the app's own engine -------------------------------------------------------
    def run_lab(self, name: str) -> None:
        """Ask, then run lab `name` on this engine in a thread worker."""
        if not self.allowed("labs"):
            return

        def done(ok: bool | None) -> None:
            if ok:
                self.ui.notify(f"Running the {name} lab… watch the block map; its progress shows above it and "
                               "its verdict opens here when done.", title="Lab", timeout=8)
                self.start_lab(name)

        db = self.recording.db
        where = (f"They are recorded as a session of their own (lab:{name}), not in this one." if self.record
                 else "They are not recorded (--no-record).")
        last = last_lab_seconds(db, name, self.backend.model_name) if self.record else None
        took = (f"Its last run from the app on this model took {last:.0f} s." if last is not None
                else "Its progress (steps done / total) shows at the top of the cache panel.")
        self.ui.push_screen(ConfirmScreen(
            f"The {name} lab runs on this engine: it clears the cache and switches modes while it runs "
            "(restoring them after), and empties the cache when done; its requests do not count in "
            f"the app's numbers. {where} {took} Typing meanwhile disturbs its measurements. Run it?"), done)

    def start_lab(self, name: str) -> None:
        """Run lab `name` now (no question asked)."""
        self.ui.run_worker(lambda: self._run_lab(name), thread=True, exclusive=True, exit_on_error=False,
                           group="lab", description="Running a lab")

    def _run_lab(self, name: str) -> None:
        module, params_cls, sizes = APP_LABS[name]
        mod = importlib.import_module(module)
        engine = self.backend.engine
        before = engine.stats(timeout=60)
        self.recording.pause(True)  # the app's session keeps the app's requests only
        rec = None
        progress = LabProgress(self.ui, lambda text: self.cache.show_lab_progress(text), name)
        try:
            if self.record:
                try:
                    rec = self._lab_recorder(name, engine)
                except EngineError as exc:  # the lab still runs, unrecorded
                    self.ui.call_from_thread(self.ui.notify, f"The {name} lab is not recorded: {exc}",
                                             severity="warning")
            result = mod.run(engine, getattr(mod, params_cls)(**sizes), LabContext(progress, rec))
        except Exception as exc:  # a lab failure is a notice, never a crash of the app
            self.ui.call_from_thread(self.ui.notify, f"{name} lab failed: {exc}", severity="error")
            return
        finally:
            # The lab leaves nothing behind: its blocks go (it cleared the app's at its start),
            # and its requests leave the app's counters. The app's session sees one clear.
            if rec is not None:
                try:
                    rec.close()
                except Exception as exc:
                    self.ui.call_from_thread(self.ui.notify, f"The {name} lab's session: {exc}", severity="warning")
            self.recording.pause(False)
            engine.clear_cache()
            after = engine.stats(timeout=60)
            self.ui.call_from_thread(self.cache.exclude, {k: after.get(k, 0) - before.get(k, 0) for k in LAB_COUNTERS})
            self.cache.mark_dirty()
            self.ui.call_from_thread(self.cache.show_lab_progress, None)
        parts = renderables(result)  # tables..., verdict, footer: show the verdict first
        title = f"lab: {name}" + (f"  (recorded as session {rec.session_id})" if rec is not None else "")
        self.ui.call_from_thread(self.ui.push_screen, LabScreen(title, [parts[-2], *parts[:-2], parts[-1]]))

    def _lab_recorder(self, name: str, engine):
        """The lab's own session (source lab:NAME, title APP_LAB_TITLE), attached to the engine."""
        rec = Recorder.open(self.recording.db, engine.config, self.backend.model_name, source=f"lab:{name}",
                            system_prompt="", title=APP_LAB_TITLE)
        rec.attach(engine)
        return rec

    # --- command palette: "category: action" -------------------------------------------------
    def commands(self) -> list[tuple[str, str, Callable]]:
        """The palette's entries for the controls this backend supports (all, while loading)."""
        cmds = [
            ("cache: clear", "Drop every cached block", self.clear_cache),
            ("mode: toggle deterministic", "Bitwise-identical results cached or not (empties the cache)",
             self.toggle_deterministic),
            ("lab: determinism", "Cached vs cold vs batched logits, default and deterministic mode",
             lambda: self.run_lab("determinism")),
            ("lab: leak", "Can another user tell a cache hit from their TTFT? (ROC AUC)",
             lambda: self.run_lab("leak")),
            ("lab: collide", "Hash collisions with a truncated hash, verify-on-hit off and on",
             lambda: self.run_lab("collide")),
            ("lab: response-cache", "A response cache vs the KV prefix cache: 'Am I pretty?'",
             lambda: self.run_lab("response-cache")),
        ]
        for mode in ISOLATION_MODES:
            cmds.append((f"isolation: {mode}", f"Set block sharing to {mode}", lambda m=mode: self.set_isolation(m)))
        for pol in EVICTION_POLICIES:
            cmds.append((f"eviction: {pol}", f"Evict cached blocks {pol} first", lambda p=pol: self.set_eviction(p)))
        controls = self.controls
        if controls is not None:  # the palette lists what this backend supports
            cmds = [c for c in cmds if (name := palette_control(c[0])) is None or controls.supports(name)]
        return cmds

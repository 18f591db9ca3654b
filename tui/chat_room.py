"""The chat room: the users' panes send turns through the backend and stream the replies back;
a script or a replay plays its turns through the same panes.

`ChatRoom` is the grid of panes (a widget): it owns the users, their panes, the shared system
prompt, the turns in flight and the script's pacing. What a conversation is, when a scripted
turn may start and how a turn's stream is consumed are sessions/conversation.py's (`kvplay run`
and headless replay use the same). Every reply streams in a thread worker of its own that only
posts messages (tui/messages.py) to this room; a finished turn goes to the cache room's bars and
timeline (`cache.turn_finished`) and to the recording room.
"""
from __future__ import annotations

import asyncio
import itertools
import time

from textual import work
from textual.containers import Vertical

from kvplay.engine.errors import EngineError
from kvplay.sessions.conversation import Pacing, consume
from kvplay.sessions.script import TurnSpec, UserSpec, sampling_for

from .messages import ReplyDelta, ReplyDone, ReplyFailed
from .controls import ControlsRoom
from .panes import ChatPane
from .recording_room import RecordingRoom
from .screens import FormScreen, TextScreen
from .theme import assign_looks

HINTS = [
    "① Start here: type a question as {name} and press Enter.",
    "② Then ask {name} something. The prompt starts with the same system prompt, so those "
    "blocks come from the first user's cache: see the badge under the reply and the + cells "
    "in the map on the right.",
    "③ Ask {name} the same question as someone else to see a bigger hit. F1 explains every colour "
    "and number.",
]


def hint(i: int, name: str) -> str:
    return HINTS[min(i, len(HINTS) - 1)].format(name=name)


class ChatRoom(Vertical):
    """Sending, streaming and autoplay for the users' panes. `looks` is the app's dict of users'
    looks (updated in place as users come); `cache` is the cache room, told of each finished
    turn (`turn_finished`), of a change a script made (`mark_dirty`), and asked whether its views
    have caught up (`settled`); `recording` records users and turns; `controls` says whether the
backend lets a user's group change."""

    def __init__(self, users: list[UserSpec], looks: dict, system_prompt: str, cache, recording: RecordingRoom,
                 controls: ControlsRoom, turns: list[TurnSpec] | None = None, speed: float = 1.0, record: bool = True,
                 timings: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.users = list(users)
        self.looks, self.system_prompt, self.cache, self.recording = looks, system_prompt, cache, recording
        self.controls = controls
        self.turns = list(turns or [])
        self.speed, self.record, self.timings = speed, record, timings
        self.backend = None  # the ChatBackend turns go to, once ready
        self._panes = {u.name: ChatPane(u, looks[u.name], hint(i, u.name)) for i, u in enumerate(self.users)}
        self.ready = asyncio.Event()
        self.autoplay_done = asyncio.Event()
        self.paused = False
        self._step = 0
        self._turn_ids = itertools.count(1)
        self._finished_turns: set[int] = set()  # turns whose reply is done or failed (autoplay's pacing)
        self._started: dict[int, float] = {}  # turn id -> wall time it was submitted
        self._inflight: dict[int, tuple[ChatPane, str]] = {}
        self._pending: list = []  # messages typed while the model was loading

    def compose(self):
        yield from self._panes.values()

    def on_mount(self) -> None:
        if self.turns:
            self._autoplay()

    @property
    def panes(self) -> list[ChatPane]:
        return list(self._panes.values())

    def pane(self, user: str) -> ChatPane:
        return self._panes[user]

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def bind(self, backend) -> None:
        """The backend is ready: each pane's identity is bound in the engine (not per message),
        the panes take input, and what was typed while loading is sent."""
        self.backend = backend
        for u in self.users:
            backend.register_user(u.name, u.group)
        for p in self.panes:
            p.set_ready(True)
        self.ready.set()
        pending, self._pending = self._pending, []
        for pane, text, turn, note in pending:
            pane.set_busy(False)
            if pane.is_attached:
                pane.chat.remove(note)  # sent now: the message and its answer take the note's place
                self.send(pane, text, turn)

    # --- sending and streaming ----------------------------------------------------------------
    def on_chat_pane_submitted(self, msg: ChatPane.Submitted) -> None:
        msg.stop()
        self.send(msg.pane, msg.text)

    def send(self, pane: ChatPane, text: str, turn: TurnSpec | None = None) -> int | None:
        if self.backend is None:
            pane.set_busy(True)
            note = pane.notice("The model is still loading; this message is sent as soon as it is ready.")
            self._pending.append((pane, text, turn, note))
            return None
        spec = pane.spec
        try:
            sampling = sampling_for(spec, turn)
        except EngineError as exc:
            pane.notice(f"✗ {exc}", error=True)
            return None
        messages = pane.conversation.messages(self.system_prompt, text)
        turn_id = next(self._turn_ids)
        pane.add_user_message(text)
        pane.start_reply(turn_id)
        pane.set_busy(True)
        self._inflight[turn_id] = (pane, text)
        opened = (self.recording.start(self.backend, self.system_prompt,
                                       [(u, self.looks[u.name].colour) for u in self.users])
                  if self.record else None)
        self._stream(opened, turn_id, spec.name, text, messages, sampling)
        return turn_id

    @work(thread=True, exit_on_error=False, group="replies", description="Streaming a reply")
    def _stream(self, opened, turn_id: int, user: str, text: str, messages: list[dict], sampling) -> None:
        if opened is not None:
            opened.result()  # the recorder listens before the first request is submitted
        started = time.time()
        self._started[turn_id] = started  # the timeline places the turn here
        try:
            handle = self.backend.submit(user, messages, sampling)  # the group: the engine's registry
        except EngineError as exc:
            self.post_message(ReplyFailed(turn_id, user, str(exc)))
            return
        except Exception as exc:
            self.post_message(ReplyFailed(turn_id, user, f"{type(exc).__name__}: {exc}"))
            return
        result = consume(handle, lambda out: self.post_message(ReplyDelta(turn_id, user, out)))
        self.post_message(ReplyDone(turn_id, user, result))
        if self.record:
            self.recording.record_turn(user, text, messages, sampling, result, started)

    def on_reply_delta(self, msg: ReplyDelta) -> None:
        msg.stop()
        entry = self._inflight.get(msg.turn_id)
        if entry is not None:
            entry[0].update_reply(msg.turn_id, msg.text)

    def on_reply_done(self, msg: ReplyDone) -> None:
        msg.stop()
        entry = self._inflight.pop(msg.turn_id, None)
        res = msg.result
        self._finished_turns.add(msg.turn_id)
        if entry is None:
            return
        pane, text = entry
        pane.finish_reply(msg.turn_id, res, self.looks, self.timings)
        pane.set_busy(False)
        if res.error is None:
            pane.conversation.add(text, res.text)
        self.cache.turn_finished(msg.user, msg.turn_id, res.stats, self._started.pop(msg.turn_id, None))

    def on_reply_failed(self, msg: ReplyFailed) -> None:
        msg.stop()
        self._finished_turns.add(msg.turn_id)
        pane, _ = self._inflight.pop(msg.turn_id, (None, None))
        self._started.pop(msg.turn_id, None)
        if pane is not None:
            pane.fail_reply(msg.turn_id, msg.error)
            pane.set_busy(False)

    # --- a script or a replay -----------------------------------------------------------------
    @work(exclusive=True, group="autoplay", exit_on_error=False, description="Playing the script")
    async def _autoplay(self) -> None:
        await self.ready.wait()
        for p in self.panes:
            p.set_ready(True, placeholder=f"replaying… type as {p.user} to join in")
        pacing = Pacing([(t.user, t.at) for t in self.turns], self.speed)
        sent: list[int | None] = []  # per script turn, its turn id (None: never sent)

        def finished(i: int) -> bool:
            return sent[i] is None or sent[i] in self._finished_turns

        t0 = time.monotonic()
        paused_for = 0.0
        for i, turn in enumerate(self.turns):
            sent.append(None)
            try:
                pane = self.pane(turn.user)
            except KeyError:
                continue
            while time.monotonic() - paused_for < t0 + pacing.due(i):  # timed turns overlap
                await asyncio.sleep(0.02)
            while not all(finished(j) for j in pacing.after[i]) or pane.busy:
                await asyncio.sleep(0.02)
            pause_start = time.monotonic()
            while self.paused and self._step == 0:
                await asyncio.sleep(0.05)
            paused_for += time.monotonic() - pause_start if self.paused else 0.0
            if self._step:
                self._step -= 1
            # a recorded or scripted F4 / F2-F5, through the engine's queue before this turn (a
            # server's own settings are not the script's to change: skipped there)
            controls = self.backend.controls
            if turn.clear and controls.clear:
                await asyncio.to_thread(self.backend.clear_cache)
                self.cache.mark_dirty()
            if turn.engine and all(controls.supports(k) for k in turn.engine):
                await asyncio.to_thread(self.backend.reconfigure, **turn.engine)
                self.cache.mark_dirty()
            if turn.group is not None and (turn.group or None) != pane.spec.group:
                self.set_user_group(pane, turn.group or None)  # a recorded or scripted change
            sent[i] = self.send(pane, turn.text, turn)
        while self.busy:
            await asyncio.sleep(0.02)
        # let the last events and state refresh land
        self.cache.mark_dirty()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if self.cache.settled:
                break
        for p in self.panes:
            p.set_ready(True)
        self.autoplay_done.set()

    def replay_pause(self) -> None:
        if not self.turns:
            self.app.notify("Pause and step work while a script or replay plays.")
            return
        self.paused = not self.paused
        self.app.notify("Replay paused: F12 plays one turn, F11 resumes." if self.paused else "Replay resumed.")

    def replay_step(self) -> None:
        if self.turns:
            self.paused = True
            self._step += 1

    # --- users and the shared prompt ----------------------------------------------------------
    def edit_system(self) -> None:
        """Ask for a new shared system prompt (for the next turns)."""
        def done(text: str | None) -> None:
            if text is not None and text.strip() and text != self.system_prompt:
                self.system_prompt = text
                self.app.notify("New system prompt: the next turns start a new shared prefix.")

        self.app.push_screen(TextScreen("Shared system prompt (every user's prompt starts with it)",
                                        self.system_prompt), done)

    def user_settings(self, pane: ChatPane) -> None:
        """Ask for the pane's user's seed, temperature, max tokens and group."""
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
                self.app.notify("Seed and max tokens must be whole numbers (max tokens ≥ 1), temperature ≥ 0.",
                                severity="error")
                return
            s.seed, s.temperature, s.max_tokens = seed, temp, max_tokens
            group = values["group"].strip() or None
            if group != s.group and not self.controls.allowed("groups"):
                group = s.group  # the backend binds groups itself: the rest still applies
            self.set_user_group(pane, group)  # records the user too
            self.app.notify(f"{s.name}: seed {seed}, temperature {temp:g}, group {s.group or '-'}")

        self.app.push_screen(FormScreen(f"Settings for {s.name}", [
            ("seed", "seed (same seed + same prompt = same reply)", str(s.seed)),
            ("temperature", "temperature (0 = greedy)", f"{s.temperature:g}"),
            ("max_tokens", "max tokens per reply", str(s.max_tokens)),
            ("group", "group (for isolation = group)", s.group or ""),
        ]), done)

    def set_user_group(self, pane: ChatPane, group: str | None) -> None:
        """Move the pane's user to `group`: the engine's registry decides (recorded as
        UserGroupChanged, applied from the user's next request); the users table keeps the
        latest settings."""
        pane.spec.group = group
        if self.backend is not None and self.backend.controls.groups:
            self.backend.set_group(pane.spec.name, group)
        pane.refresh_subtitle()
        self.recording.add_user(pane.spec, self.looks[pane.spec.name].colour)

    def add_user(self, spec: UserSpec) -> ChatPane:
        """A new user with a pane of its own (mounted last), bound in the backend if it is ready."""
        self.users.append(spec)
        self.looks.update(assign_looks([u.name for u in self.users], {spec.name: spec.colour}, self.looks))
        pane = ChatPane(spec, self.looks[spec.name], hint(len(self._panes), spec.name))
        self._panes[spec.name] = pane
        self.mount(pane)
        if self.backend is not None:
            try:
                self.backend.register_user(spec.name, spec.group)
            except EngineError:  # a removed pane's user comes back in another group (local engine)
                self.backend.set_group(spec.name, spec.group)
            pane.call_after_refresh(pane.set_ready, True)
        if self.record:
            self.recording.add_user(spec, self.looks[spec.name].colour)
        return pane

    def remove_user(self, pane: ChatPane) -> None:
        """The pane and its user go (their blocks stay in the pool until evicted)."""
        self.users = [u for u in self.users if u.name != pane.user]
        self._panes.pop(pane.user, None)
        pane.remove()

"""The chat room: the users' panes send turns through the backend and stream the replies back;
a script or a replay plays its turns through the same panes.

What a conversation is, when a scripted turn may start and how a turn's stream is consumed are
sessions/conversation.py's (`kvplay run` and headless replay use the same). Every reply streams
in a thread worker of its own that only posts messages (tui/messages.py); the handlers here
update the panes, the request bars and the timeline.
"""
from __future__ import annotations

import asyncio
import time

from textual import work
from textual.widgets import Tab

from kvplay.engine.errors import EngineError
from kvplay.sessions.conversation import Pacing, consume
from kvplay.sessions.script import TurnSpec, UserSpec, sampling_for

from .messages import ReplyDelta, ReplyDone, ReplyFailed
from .panes import ChatPane
from .screens import ConfirmScreen, FormScreen, TextScreen
from .theme import assign_looks
from .timeline import Timeline, result_span
from .widgets import CACHE_TAB


class ChatRoom:
    """Sending, streaming and autoplay (a part of KvplayApp: it reads the app's backend, panes,
    recorder and counters)."""

    def on_chat_pane_submitted(self, msg: ChatPane.Submitted) -> None:
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
        entry = self._inflight.get(msg.turn_id)
        if entry is not None:
            entry[0].update_reply(msg.turn_id, msg.text)

    def on_reply_done(self, msg: ReplyDone) -> None:
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
        self._requests.append(res.stats)
        started = self._started.pop(msg.turn_id, None)
        if started is not None and res.stats.prompt_tokens:
            self._spans.append(result_span(res.stats, started, msg.turn_id))
            self.query_one(Timeline).set_spans(list(self._spans), self.looks, time.time())
        if res.stats.ttft_ms is not None:
            self._ttft.setdefault(msg.user, []).append(res.stats.ttft_ms)
        self._update_requests()
        self._dirty = True

    def on_reply_failed(self, msg: ReplyFailed) -> None:
        self._finished_turns.add(msg.turn_id)
        pane, _ = self._inflight.pop(msg.turn_id, (None, None))
        self._started.pop(msg.turn_id, None)
        if pane is not None:
            pane.fail_reply(msg.turn_id, msg.error)
            pane.set_busy(False)

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

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
                self._dirty = True
            if turn.engine and all(controls.supports(k) for k in turn.engine):
                await asyncio.to_thread(self.backend.reconfigure, **turn.engine)
                self._dirty = True
            if turn.group is not None and (turn.group or None) != pane.spec.group:
                self.set_user_group(pane, turn.group or None)  # a recorded or scripted change
            sent[i] = self.send(pane, turn.text, turn)
        while self.busy:
            await asyncio.sleep(0.02)
        # let the last events and state refresh land
        self._dirty = True
        for _ in range(100):
            await asyncio.sleep(0.02)
            if self.settled:
                break
        for p in self.panes:
            p.set_ready(True)
        self.autoplay_done.set()

    def action_replay_pause(self) -> None:
        if not self.turns:
            self.notify("Pause and step work while a script or replay plays.")
            return
        self.paused = not self.paused
        self.notify("Replay paused: F12 plays one turn, F11 resumes." if self.paused else "Replay resumed.")

    def action_replay_step(self) -> None:
        if self.turns:
            self.paused = True
            self._step += 1

    # --- users and the shared prompt ------------------------------------------------------------
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
            if group != s.group and not self.controls.allowed("groups"):
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


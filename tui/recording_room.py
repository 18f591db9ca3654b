"""The recording room: the app's session in SQLite (sessions/recorder.py), written on one
thread of its own (never the engine thread, never the UI's). A session opens at the first turn
(an app closed without a turn records nothing); a recording failure is one notice, never a
crash of the playground.
"""
from __future__ import annotations

from kvplay.sessions.script import UserSpec


class RecordingRoom:
    """The recorder's calls, on the app's recorder thread (a part of KvplayApp)."""

    def _recorder_call(self, fn, *args) -> None:
        self._rec_pool.submit(self._guarded, fn, *args)

    def _start_recording(self):
        """Open the session at the first turn (an app closed without a turn records nothing).
        Returns a future the reply workers wait on, so the recorder sees every event of the
        first request."""
        if self._recorder_opened is None:
            self._recorder_opened = self._rec_pool.submit(self._guarded, self._open_recorder)
        return self._recorder_opened

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # recording must never break the playground
            if self.recorder_error is None:
                self.recorder_error = f"{type(exc).__name__}: {exc}"

    def _open_recorder(self) -> None:
        # start-up time: imported when this first runs
        from kvplay.sessions.recorder import Recorder

        if self.backend is None:
            return
        rec = Recorder.open(self.db, self.engine.config if self.engine else None, self.backend.model_name,
                            source="replay" if self.replay_of else "app", system_prompt=self.system_prompt,
                            title=self._title, replay_of=self.replay_of)
        if not self._recording_paused:  # (a lab resumes it when done)
            rec.attach(self.engine or self.backend)  # the engine: its step clock goes with each event
        self.recorder = rec
        for u in self.users:
            self._record_user(u)

    def _record_user(self, u: UserSpec) -> None:
        if self.recorder is not None:
            self.recorder.add_user(u.name, group=u.group, colour=self.looks[u.name].colour, seed=u.seed,
                                   temperature=u.temperature, max_tokens=u.max_tokens, top_p=u.top_p,
                                   top_k=u.top_k)

    def _record_turn(self, user, text, messages, sampling, result, started) -> None:
        if self.recorder is not None:
            self.recorder.record_turn(user, text, messages, sampling, result, started=started)

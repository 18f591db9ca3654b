"""The recording room: the app's session in SQLite (sessions/recorder.py), written on one
thread of its own (never the engine thread, never the UI's). A session opens at the first turn
(an app closed without a turn records nothing); a recording failure is one notice, never a
crash of the playground.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from kvplay.sessions.recorder import Recorder
from kvplay.sessions.script import UserSpec


class RecordingRoom:
    """The app's recorder and the one thread every call to it runs on. Owns nothing of the UI:
    the app reads `error` and says so."""

    def __init__(self, db: str | None, replay_of: str | None = None, title: str | None = None) -> None:
        self.db, self.replay_of, self.title = db, replay_of, title
        self.recorder = None
        self.error: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvplay-recorder")
        self._opened: Future | None = None  # the recorder's opening (first turn)
        self._paused = False  # a lab runs: the app's session takes no engine events
        self._source = None  # what the recorder listens to: the engine, or a remote backend

    def call(self, fn, *args) -> Future:
        """Run `fn(*args)` on the recorder's thread; a failure becomes `error`, never raised."""
        return self._pool.submit(self._guarded, fn, *args)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # recording must never break the playground
            if self.error is None:
                self.error = f"{type(exc).__name__}: {exc}"

    def start(self, backend, system_prompt: str, users: list[tuple[UserSpec, str]]) -> Future:
        """Open the session at the first turn (`users`: each spec and its colour). Returns a
        future the reply workers wait on, so the recorder sees every event of the first request."""
        if self._opened is None:
            self._opened = self.call(self._open, backend, system_prompt, users)
        return self._opened

    def _open(self, backend, system_prompt: str, users: list[tuple[UserSpec, str]]) -> None:
        engine = getattr(backend, "engine", None)  # None on a remote server
        rec = Recorder.open(self.db, engine.config if engine else None, backend.model_name,
                            source="replay" if self.replay_of else "app", system_prompt=system_prompt,
                            title=self.title, replay_of=self.replay_of)
        self._source = engine or backend  # the engine: its step clock goes with each event
        if not self._paused:  # (a lab resumes it when done)
            rec.attach(self._source)
        self.recorder = rec
        for spec, colour in users:
            self._add_user(spec, colour)

    def add_user(self, spec: UserSpec, colour: str) -> None:
        """Record a user (new, or its settings changed); the users table keeps the latest."""
        self.call(self._add_user, spec, colour)

    def _add_user(self, u: UserSpec, colour: str) -> None:
        if self.recorder is not None:
            self.recorder.add_user(u.name, group=u.group, colour=colour, seed=u.seed,
                                   temperature=u.temperature, max_tokens=u.max_tokens, top_p=u.top_p,
                                   top_k=u.top_k)

    def record_turn(self, user, text, messages, sampling, result, started) -> None:
        self.call(self._record_turn, user, text, messages, sampling, result, started)

    def _record_turn(self, user, text, messages, sampling, result, started) -> None:
        if self.recorder is not None:
            self.recorder.record_turn(user, text, messages, sampling, result, started=started)

    def pause(self, paused: bool) -> None:
        """Stop (or resume) taking the engine's events into the app's session; on the recorder's
        thread, and waited for, so no lab event lands in the app's session."""
        def apply() -> None:
            self._paused = paused
            if self.recorder is not None:
                if paused:
                    self.recorder.detach()
                else:
                    self.recorder.attach(self._source)

        self.call(apply).result()

    def close(self) -> None:
        """Close the session; every finished turn is written before this returns."""
        if self.recorder is not None:
            self.call(self.recorder.close)
        self._pool.shutdown(wait=True)

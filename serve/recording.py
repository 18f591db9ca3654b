"""What kvplay serve writes to its session: each user once, then each finished turn.

Writes run on one worker thread of their own (in order: a user before that user's turns),
never on the engine thread and never on the HTTP event loop. A failing DB never breaks a
reply: the first failure is said once on stderr, later ones are counted.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor


class ServeRecording:
    def __init__(self, recorder):
        self.recorder = recorder
        self.failures = 0
        self._users: set[str] = set()
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvplay-record")

    def note_user(self, user: str, group: str | None, wait: bool = False) -> None:
        """Record `user` the first time it is seen (queued; `wait`: written before returning)."""
        with self._lock:
            if user in self._users:
                return
            self._users.add(user)
        try:
            fut = self._writer.submit(self._safe, self.recorder.add_user, user, group=group)
        except RuntimeError:  # closed
            self.failures += 1
            return
        if wait:
            fut.result()

    def turn(self, user: str, text: str, messages: list, sampling, prompt: tuple, started: float):
        """A callback for a request's RequestResult that queues the turn's write."""
        def on_result(result) -> None:  # on the engine thread: only queues
            try:
                self._writer.submit(self._safe, self.recorder.record_turn, user, text, messages, sampling, result,
                                    started=started, prompt=prompt)
            except RuntimeError:  # closed: a turn still running when the server stopped
                self.failures += 1
        return on_result

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def _safe(self, fn, *args, **kw) -> None:
        try:
            fn(*args, **kw)
        except Exception as exc:  # a failing DB never breaks a reply; say it once
            self.failures += 1
            if self.failures == 1:
                print(f"kvplay serve: recording failed ({exc}); serving goes on", file=sys.stderr, flush=True)

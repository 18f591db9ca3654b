"""`kvplay watch` as a user runs it (a subprocess whose lines arrive in a queue), and a publisher
restarted on the endpoints its consumers were given."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from .wait import wait_for

KVPLAY = [sys.executable, "-m", "kvplay"]


class Watch:
    """`kvplay watch` in a subprocess; its stdout lines arrive in a queue."""

    def __init__(self, *args):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(KVPLAY + ["watch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, args=(self.p.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.p.stderr, self.err.append), daemon=True).start()

    @staticmethod
    def _read(f, put):
        for line in f:
            put(line.rstrip("\n"))

    def wait_err(self, text, timeout=60):
        def said() -> bool:
            if any(text in e for e in self.err):
                return True
            assert self.p.poll() is None, f"watch exited ({self.p.returncode})"
            return False

        try:
            wait_for(said, timeout, f"{text!r} on watch's stderr", poll=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.err}") from None

    def until(self, pred, timeout=20, feed=None):
        """Read JSON lines until pred(line) (calling feed() between reads); returns all read."""
        got = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                d = json.loads(self.lines.get(timeout=0.05))
            except queue.Empty:
                if feed is not None:
                    feed()
                continue
            got.append(d)
            if pred(d):
                return got
        raise AssertionError(f"timed out after {got[-5:]}; stderr {self.err}")

    def stop(self):
        self.p.send_signal(signal.SIGINT)
        self.p.wait(30)
        rest = []
        while not self.lines.empty():
            rest.append(json.loads(self.lines.get()))
        return rest


def restart(publisher, ep, rep):
    """A new publisher on the same endpoints, once they are free again (ZeroMQ frees a closed
    socket's port asynchronously; the ports stay reserved for the test meanwhile)."""
    from kvplay.engine.errors import EngineError

    def bound():
        try:
            return publisher(ep, rep)
        except EngineError:
            return None

    return wait_for(bound, 5, f"{ep} and {rep} to be free to bind again", poll=0.05)

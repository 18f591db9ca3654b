"""The HTTP process's end of the engine-core process (serve/core_proc.py): `RemoteSide` starts
the core, waits for it to be ready, and then offers the front end the same interface as an
in-process `EngineSide` (serve/engine_side.py).

One reader thread takes the core's messages: each step's deltas and results go to their
handles (which post them to the event loop, serve/bridge.py); replies resolve their waiters.
If the core dies, every turn in flight ends with an "engine shut down" error (503), new turns
are refused, and /health says 503 — as it does when the core stops sending its heartbeat.
"""
from __future__ import annotations

import asyncio
import itertools
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from kvplay.engine.errors import EngineError
from kvplay.engine.request import RequestHandle, RequestResult, RequestStats

from .link import Link, LinkClosed

BEAT_STALE_S = 10.0  # no heartbeat for this long: /health says the engine is down
ACK_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 20.0
GONE = "engine shut down: the engine-core process exited"


def _failed(request_id: str, user: str, error: str) -> RequestResult:
    return RequestResult(request_id, user, "", [], RequestStats(request_id, user), "abort", error=error)


class RemoteSide:
    def __init__(self, params, python: str | None = None):
        ours, theirs = socket.socketpair()
        self.link = Link(ours)
        self.proc = subprocess.Popen([python or sys.executable, "-m", "kvplay.serve.core_proc", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self._handles: dict[str, RequestHandle] = {}
        self._waiters: dict = {}
        self._ids = itertools.count()
        self._beat = (time.monotonic(), True, None)
        self._closed = False
        try:
            self.link.send(("start", params))
            msg = self.link.recv()  # the core loads the model meanwhile (its lines go to stderr)
            if msg[0] == "fatal":
                raise EngineError(msg[1])
        except LinkClosed:
            code = self.proc.wait()
            self.link.close()
            raise EngineError(f"the engine-core process exited during start-up (exit code {code})") from None
        except BaseException:
            self._kill()
            raise
        info = msg[1]
        self.tokenizer = info["tokenizer"]
        self.model_name = info["model_name"]
        self.config = info["config"]
        self.max_positions = info["max_positions"]
        self.num_blocks = info["num_blocks"]
        self.events_info = info["events_info"]
        self.recording_info = info["recording_info"]
        self._beat = (time.monotonic(), True, None)
        self._reader = threading.Thread(target=self._read, name="kvplay-core-link", daemon=True)
        self._reader.start()

    # --- the front end's interface (as EngineSide's) -------------------------------------------
    @property
    def alive(self) -> bool:
        at, alive, _failure = self._beat
        return (not self._closed and not self.link.closed and self.proc.poll() is None and alive
                and time.monotonic() - at < BEAT_STALE_S)

    async def asubmit(self, s) -> RequestHandle:
        """The turn's handle (the engine's own kind, fed by the link's reader: `forward_to`,
        `cancel`); EngineError when the core refuses it or is gone."""
        if not self.alive:
            raise EngineError(GONE)
        h = RequestHandle(s.request_id, s.user, self)
        self._handles[s.request_id] = h  # before sending: the first deltas may beat the ack
        fut: Future = Future()
        self._waiters[("ack", s.request_id)] = fut
        try:
            self.link.send(("submit", s))
            await asyncio.wait_for(asyncio.wrap_future(fut), ACK_TIMEOUT_S)
        except (LinkClosed, asyncio.TimeoutError):
            self._forget(s.request_id)
            self._send(("cancel", s.request_id))  # if the core took it after all, it frees its blocks
            raise EngineError("engine shut down: the engine-core process does not answer") from None
        except EngineError:  # refused: the core holds nothing of it
            self._forget(s.request_id)
            raise
        except BaseException:  # the client left while the core took the turn in
            self._forget(s.request_id)
            self._send(("cancel", s.request_id))
            raise
        return h

    def cancel(self, request_id: str) -> None:
        """Cancel a turn in the core (RequestHandle.cancel calls this); a finished one is left."""
        if request_id in self._handles:
            self._send(("cancel", request_id))

    def stats(self, timeout: float = 0.2) -> dict:
        return self._call("stats", timeout, wait=timeout + 10)

    def metrics_snapshot(self) -> dict:
        return self._call("metrics_snapshot")

    def clear_cache(self) -> int:
        return self._call("clear_cache", wait=120)

    def register_user(self, user: str, group: str | None) -> None:
        self._call("register_user", user, group)

    def close(self) -> None:
        """Stop the core (it closes the session and the engine) and wait for it."""
        if self._closed:
            return
        self._closed = True
        self._send(("close",))
        try:
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            print(f"kvplay serve: the engine-core process did not stop within {CLOSE_WAIT_S:g} s; killing it",
                  file=sys.stderr, flush=True)
            self._kill()
        self.link.close()
        self._reader.join(5)

    # --- internals -----------------------------------------------------------------------------
    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.link.close()

    def _send(self, msg) -> None:
        try:
            self.link.send(msg)
        except LinkClosed:
            pass

    def _forget(self, rid: str) -> None:
        self._handles.pop(rid, None)
        self._waiters.pop(("ack", rid), None)

    def _call(self, name: str, *args, wait: float = 30.0):
        cid = next(self._ids)
        fut: Future = Future()
        self._waiters[("call", cid)] = fut
        try:
            self.link.send(("call", cid, name, args))
        except LinkClosed:
            self._waiters.pop(("call", cid), None)
            raise EngineError(GONE) from None
        try:
            return fut.result(wait)
        except TimeoutError:
            raise EngineError(f"the engine-core process did not answer {name} within {wait:g} s") from None
        finally:
            self._waiters.pop(("call", cid), None)

    def _read(self) -> None:
        try:
            while True:
                msg = self.link.recv()
                op = msg[0]
                if op == "out":
                    for item in msg[1]:
                        rid = item.request_id
                        h = self._handles.get(rid)
                        if h is None:
                            continue
                        if not hasattr(item, "token_id"):
                            del self._handles[rid]
                        h._put(item)
                elif op == "beat":
                    self._beat = (time.monotonic(), bool(msg[1]), msg[2])
                elif op in ("accepted", "refused"):
                    fut = self._waiters.pop(("ack", msg[1]), None)
                    if op == "refused":
                        self._handles.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        if op == "accepted":
                            fut.set_result(True)
                        else:
                            fut.set_exception(EngineError(msg[2]))
                elif op == "reply":
                    fut = self._waiters.get(("call", msg[1]))
                    if fut is not None and not fut.done():
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(EngineError(msg[3]))
        except LinkClosed:
            pass
        except Exception as exc:  # a message this side cannot read: say it, then treat the core as gone
            print(f"kvplay serve: the engine-core link failed ({type(exc).__name__}: {exc})", file=sys.stderr,
                  flush=True)
            self.link.close()
        finally:
            self._gone()

    def _gone(self) -> None:
        """The link ended: every waiter and every turn in flight gets its answer."""
        self.link.closed = True
        if not self._closed:
            try:
                code = self.proc.wait(2)
            except subprocess.TimeoutExpired:
                code = None
            print("kvplay serve: the engine-core process exited" + (f" (code {code})" if code is not None else "")
                  + "; /health now says 503 and requests get 503", file=sys.stderr, flush=True)
        for key, fut in list(self._waiters.items()):
            self._waiters.pop(key, None)
            if not fut.done():
                fut.set_exception(EngineError(GONE))
        for rid, h in list(self._handles.items()):
            self._handles.pop(rid, None)
            h._put(_failed(rid, h.user, GONE))

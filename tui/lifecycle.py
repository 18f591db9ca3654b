"""How an app's event loop ends: its blocking work runs on daemon threads, so quitting never
waits for it.

Textual's thread workers (and `asyncio.to_thread`) run on the loop's default executor. The
standard `ThreadPoolExecutor`'s threads are joined when `asyncio.run` closes the loop (with no
time limit on Python 3.11) and again at interpreter exit, so a model still loading (tens of
seconds, or for ever on a stuck file system), a lab still running or a reply waiting on a step
kept `kvplay` alive after ctrl+q. That is why the app used to end with `os._exit(0)`.

Here the loop's default executor is a `DaemonExecutor`: one daemon thread per job, and a
shutdown that waits at most `QUIT_WAIT_S` for them. The app's `on_unmount` shuts the engine
down first, which ends every request a worker waits on, so in practice they have ended by then;
one that has not (a model load) no longer holds the app: the UI closes at once.

The process itself still waits for such a worker before the interpreter finalises (at most
`EXIT_WAIT_S`, saying so on stderr): a daemon thread still inside native code (torch converting
or loading weights) while C++ static objects are destroyed at exit aborts the process
("terminate called without an active exception", seen in CI when quitting during the first
model conversion).
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
QUIT_WAIT_S = 2.0  # how long closing the loop waits for workers still running
EXIT_WAIT_S = 120.0  # how long the process waits at exit for a worker still running (a first
# model conversion takes 21-73 s here); one stuck for ever is then left to the OS
_executors: "weakref.WeakSet[DaemonExecutor]" = weakref.WeakSet()


class DaemonExecutor(ThreadPoolExecutor):
    """An executor whose every job runs on a daemon thread of its own, never joined at exit.
    (A ThreadPoolExecutor by type only, as asyncio's set_default_executor asks: none of its
    pool machinery runs; submit and shutdown are these.)"""

    def __init__(self, name: str = "kvplay-worker") -> None:
        super().__init__(max_workers=1, thread_name_prefix=name)
        self._name = name
        self._ids = itertools.count(1)
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        _executors.add(self)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        fut: Future = Future()

        def run() -> None:
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        value = fn(*args, **kwargs)
                    except BaseException as exc:
                        fut.set_exception(exc)
                    else:
                        fut.set_result(value)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            t = threading.Thread(target=run, name=f"{self._name}-{next(self._ids)}", daemon=True)
            self._threads.add(t)
        t.start()
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if wait:
            end = time.monotonic() + QUIT_WAIT_S
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))

    @property
    def running(self) -> list[threading.Thread]:
        with self._lock:
            return [t for t in self._threads if t.is_alive()]


@atexit.register
def _wait_for_workers() -> None:
    """At interpreter exit (before finalisation): let a worker still running (a model load) end,
    so no thread is inside torch's native code while the process tears down."""
    running = [t for ex in list(_executors) for t in ex.running]
    if not running:
        return
    print(f"kvplay: waiting for {len(running)} background job(s) (a model load) to finish before "
          "exiting…", file=sys.stderr, flush=True)
    end = time.monotonic() + EXIT_WAIT_S
    for t in running:
        t.join(max(0.0, end - time.monotonic()))


def _new_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_default_executor(DaemonExecutor())
    return loop


def run_until_done(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)` on a loop whose workers never hold the process (see above)."""
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(coro)


def run_app(app, **kwargs):
    """Run a Textual app (blocking) until it quits; returns its return value."""
    return run_until_done(app.run_async(**kwargs))

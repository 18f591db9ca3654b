"""Which threads run torch's parallel work.

libgomp (the OpenMP runtime torch ships on Linux) keeps a pool of worker threads for *every*
thread that has ever started a parallel region, for as long as that thread lives. Once the
workers of all pools outnumber the cores, every OpenMP barrier stops spinning and sleeps in the
kernel (libgomp's "throttled" wait), and a step of small ops slows down badly: the model loaded
on a server's main thread and then run on the engine thread measured a one-row decode step at
61 ms against 34 ms at two threads on a 2-core machine (issue #22). So the engine's thread is
the only long-lived thread that runs torch in parallel: the model is loaded and the runner built
on a thread that ends when they are done (``on_fresh_thread``), which frees its pool.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def cpu_threads(threads: int | None) -> int:
    """The intra-op threads asked for: `threads`, or one less than the cores, so the UI,
    recorder and tokenizer keep a core; with every core busy, OpenMP threads spin-wait on each
    other and a 1 ms GEMM was measured at 6-27 ms on this 2-core machine."""
    return threads or max(1, (os.cpu_count() or 2) - 1)


def set_cpu_threads(threads: int | None) -> int:
    """torch's intra-op threads for the process, and for the calling thread's OpenMP runtime
    (libgomp reads the count per thread: the engine thread sets it again when it starts)."""
    n = cpu_threads(threads)
    torch.set_num_threads(n)
    return n


def on_fresh_thread(fn: Callable[..., T], *args) -> T:
    """`fn(*args)` on a new thread that ends when it returns, so any OpenMP pool it made goes
    with it; its result, or its exception re-raised here. A Ctrl-C while it runs waits for it
    (it is in native code: leaving it behind aborts the interpreter at exit), then propagates."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name="kvplay-load", daemon=True)
    thread.start()
    try:
        thread.join()
    except KeyboardInterrupt:
        thread.join()
        raise
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]

"""Waiting on a condition instead of sleeping: `wait_for(pred)` polls until `pred()` is true and
fails with what it waited for when it is not within `timeout` seconds. `before` runs before each
look: a probe that makes the condition observable (publish a batch until a subscriber sees one,
let a guard take its monitor's news)."""
from __future__ import annotations

import linecache
import time
from typing import Callable, TypeVar

T = TypeVar("T")

POLL_S = 0.02


def describe(pred: Callable) -> str:
    """The source line of `pred` (a lambda as written in the test), else its name."""
    code = getattr(pred, "__code__", None)
    if code is not None:
        line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
        if line:
            return f"{line}  ({code.co_filename.rpartition('/')[2]}:{code.co_firstlineno})"
    return getattr(pred, "__qualname__", repr(pred))


def wait_for(pred: Callable[[], T], timeout: float = 15.0, what: str | None = None, poll: float = POLL_S,
             before: Callable[[], object] | None = None) -> T:
    """`pred()`'s first true value, polled every `poll` seconds (after `before()`, if given);
    AssertionError naming the condition (`what`, else the predicate's source line) when
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        if before is not None:
            before()
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what or describe(pred)}")
        time.sleep(poll)  # the poll interval: the condition is checked again

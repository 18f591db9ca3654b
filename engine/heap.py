"""Freed step memory kept in the process's heap, for the next step to reuse.

A prompt chunk's forward allocates megabytes of activations a layer (540 rows of SmolLM2-135M:
tensors of 1-7 MB) and frees them by the end of the step. glibc's malloc hands out blocks that
big by mmap and gives them back by munmap (its threshold rises only to the largest block freed so
far), and trims the top of a heap once 128 KB are free there: so step after step faulted its
activations' pages in again, zero-filled by the kernel. vLLM's CPU backend avoids it with the
tcmalloc it preloads. Measured on the 2-core EPYC (2026-12-06, SmolLM2-135M, float32): a
540-row forward after a first one, one thread, 9-16 thousand page faults and 20-30 ms of system
time (581 ms in all), against none and 550 ms with the thresholds below. What a fault costs
varies with the machine's state (this one is a VM): the cold TTFT of alice's 540-token prompt
(examples/shared-system.toml) in an engine warmed up as the bench warms it measured 774 -> ~590
ms at one thread and 502 -> ~330 ms at two in one session, and ~620 -> ~600 ms an hour later.

`keep_freed_memory()` sets malloc's mmap threshold to its largest value (32 MB on 64-bit: a
step's tensors come from the heap) and its trim threshold to 1 GB (a step's freed memory stays
in the heap for the next one): the process keeps its peak step memory after a step instead of
faulting it in again. glibc only; it does nothing where the process runs another allocator,
where the user set malloc's thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
GLIBC_TUNABLES), or where `KVPLAY_HEAP=0`.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30

_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_done: dict[str, str | None] = {}


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


def keep_freed_memory() -> str | None:
    """Set the thresholds once per process; None when set, else why not (in words)."""
    if "why" in _done:
        return _done["why"]
    why = None
    if os.environ.get("KVPLAY_HEAP", "1") == "0":
        why = "KVPLAY_HEAP=0"
    elif any(os.environ.get(k) for k in _USER_KNOBS):
        why = "malloc's thresholds set in the environment"
    elif not _glibc():
        why = "not glibc"
    else:
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
                why = "mallopt refused"
        except (OSError, AttributeError):
            why = "no mallopt"
    _done["why"] = why
    return why

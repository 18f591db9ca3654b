"""The compiled per-event loop of the watch side's miss attribution (csrc/miss_chains.c): a
CPython extension built on first use with the host's C compiler (engine/cbuild.py, cached by a
hash of the source, the flags and the Python it is built for), then imported from the cache.

`scan()`, `flusher()`, `filterer()`, `recent_map()` and `pending()` are None where it cannot be built or loaded (no compiler,
no Python headers, a failed build) or where `KVPLAY_NATIVE=0`: PodMisses then runs its Python
loop, which gives the same results at a higher cost (`python -m kvplay.bench.mirror_bench
--no-socket --misses`, docs/miss.md).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
import sysconfig
import threading
from pathlib import Path

from kvplay.engine import cbuild
from kvplay.engine import events as ev_
from kvplay.engine import miss
from kvplay.engine.miss import Removal

log = logging.getLogger(__name__)

# each counted reason's place in a session's counts, as csrc/miss_chains.c numbers them
PLACES = {"tier": 0, "evicted": 1, "cleared": 2, "config": 3, "isolated": 4, "diverged": 5, "cold": 6}

NAME = "kvplay_miss_chains"
SOURCE = Path(__file__).parent / "csrc" / "miss_chains.c"
HEADERS = [Path(__file__).parent / "csrc" / "recent_map.h", Path(__file__).parent / "csrc" / "pending.h"]
FLAGS = ["-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-I" + sysconfig.get_paths()["include"]]

_lock = threading.Lock()
_state: dict = {}  # cbuild.load_once's: "value" (the module or None, once tried), "why" (why not)


def has_headers() -> bool:
    """Whether this Python's headers (Python.h) are installed: an extension is built against them."""
    return os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


def _load():
    if os.environ.get("KVPLAY_NATIVE", "1") == "0":
        return None, cbuild.OFF
    if not has_headers():
        return None, "no Python headers (Python.h)"
    target, why = cbuild.built(NAME, [SOURCE], HEADERS, FLAGS, suffix=sysconfig.get_config_var("EXT_SUFFIX") or ".so",
                               extra=sys.version)
    if target is None:
        return None, why
    try:
        spec = importlib.util.spec_from_file_location(NAME, target)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.setup(ev_.BlockStored, ev_.BlockRemoved, ev_.BlockHit, ev_.TierBlocks, ev_.AllBlocksCleared,
                  Removal, PLACES)
    except (ImportError, OSError, AttributeError, TypeError) as e:
        target.unlink(missing_ok=True)  # a damaged cache entry: the next start builds it again
        return None, f"load failed: {e}"
    return mod, None


def module():
    """The compiled module (`scan`, `flush`), built and loaded once per process; None where it
    cannot be (`why_not()` says why, logged once)."""
    return cbuild.load_once(_state, _lock, _load, log, "compiled miss attribution unavailable (%s); using Python")


def scan(places: dict):
    """The compiled `PodMisses._scan` (None where there is none); `places`: each reason's place
    in a session's counts (wire/miss_watch.py's), checked against the module's."""
    mod = module()
    if mod is None:
        return None
    if places != PLACES:
        raise ValueError("the reasons' places changed: csrc/miss_chains.c counts them in its own order")
    return mod.scan


def recent_map():
    """The compiled RemovedLog recent map's type, `RecentMap(capacity)` (csrc/recent_map.h; None
    where there is none)."""
    mod = module()
    return None if mod is None else mod.RecentMap


def pending():
    """A new `Pending` (csrc/pending.h): a pod's counts its counters have not been given yet, which
    the compiled loop adds to and PodMisses settles before its counters are read (None where
    there is no compiled module)."""
    mod = module()
    return None if mod is None else mod.Pending()


def flusher():
    """The compiled `RemovedLog.flush`, for a log whose recent map is a `RecentMap` (None where
    there is none)."""
    mod = module()
    return None if mod is None else mod.flush


def filterer():
    """The compiled `RemovedLog.filtered` (None where there is none)."""
    mod = module()
    if mod is None or miss._REMOVAL_KINDS != ("evicted", "cleared", "config"):  # (the order it checks them in)
        return None
    return mod.filtered


def why_not() -> str | None:
    return _state.get("why")

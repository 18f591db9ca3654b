"""A step's freed activations stay in the heap for the next step (engine/heap.py).

Each probe runs in a fresh interpreter (malloc's thresholds are per process and cannot be
unset): it frees a 9 MB tensor once touched, then counts the page faults of touching an 8 MB
one. With glibc's defaults the first goes back to the kernel (munmap) when freed and the second
faults its ~2000 pages in; with the thresholds an Engine sets, it reuses the first's pages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.engine.heap import keep_freed_memory

    Engine(EngineConfig(model="tiny:llama", num_blocks=8))  # built, not started: sets the heap up
    why = keep_freed_memory()  # once per process: the Engine's answer again
    n = 2 << 20  # floats: 8 MB
    a = torch.empty(n + (1 << 18))  # 1 MB more: the hole it leaves fits the next one, alignment and all
    a.fill_(1.0)
    del a
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b = torch.empty(n)
    b.fill_(2.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(json.dumps({"why": why, "faults": faults}))
""")

glibc = pytest.mark.skipif(not hasattr(os, "confstr") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                           reason="malloc's thresholds are glibc's")


def probe(**env) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("KVPLAY_HEAP", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                          "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_an_engine_keeps_freed_step_memory_for_reuse():
    got = probe()
    assert got["why"] is None
    assert got["faults"] < 256, got  # ~2000 (of 2048 pages) when they go back to the kernel


@glibc
def test_kvplay_heap_0_leaves_malloc_as_it_is():
    got = probe(KVPLAY_HEAP="0")
    assert got["why"] == "KVPLAY_HEAP=0"
    assert got["faults"] >= 1024, got  # what the first test's bound tells apart


@glibc
def test_thresholds_the_user_set_are_left_alone():
    got = probe(MALLOC_TRIM_THRESHOLD_="131072")
    assert got["why"] == "malloc's thresholds set in the environment"

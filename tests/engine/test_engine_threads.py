"""Torch's parallel work stays on the engine thread (engine/threads.py, issue #22).

libgomp keeps an OpenMP worker pool for every thread that ever ran a parallel region, for that
thread's life; once pools outnumber the cores, every barrier sleeps in the kernel and a step
slows down (a one-row decode step in `kvplay serve --threads 2`: 61 ms against 34 ms). These
tests count the process's OS threads in a fresh interpreter: building an Engine on the embedded
model (loading and packing its weights run parallel regions) must leave no worker behind on the
constructing thread.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch
    from kvplay.engine.config import EngineConfig
    from kvplay.engine.engine import Engine
    from kvplay.engine.sampling import SamplingParams
    from kvplay.engine.threads import on_fresh_thread

    def tasks():
        # the OS threads once exiting ones are gone (a joined thread and the pool workers it
        # releases leave the task list a moment later): the count once it has held for 0.3 s
        last, since, end = None, time.monotonic(), time.monotonic() + 10
        while time.monotonic() < end:
            n = len(os.listdir("/proc/self/task"))
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= 0.3:
                break
            time.sleep(0.02)  # the sampling interval of that measurement (a child: no test helpers)
        return last

    torch.set_num_threads(2)
    out = {"start": tasks()}
    on_fresh_thread(lambda: torch.ones(1 << 22).add_(1))  # a parallel region on a thread that ends
    out["after_fresh_thread"] = tasks()
    eng = Engine(EngineConfig(threads=2, cache_mb=16))
    out["after_build"] = tasks()
    eng.start()
    eng.generate("alice", [{"role": "user", "content": "hello"}],
                 SamplingParams(temperature=0.0, max_tokens=2, stop_on_eos=False))
    out["running"] = tasks()
    eng.shutdown()
    torch.ones(1 << 22).add_(1)  # this thread's own pool: one worker (the control)
    out["after_main_region"] = tasks()
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_building_an_engine_leaves_no_openmp_pool_on_the_callers_thread():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    n = json.loads(done.stdout.strip().splitlines()[-1])
    assert n["after_fresh_thread"] == n["start"], n  # the fresh thread's pool went with it
    assert n["after_build"] == n["start"], n         # the build ran on such a thread
    assert n["running"] >= n["start"] + 1, n          # the engine thread (and its own workers)
    assert n["after_main_region"] == n["after_build"] + 1, n  # the control: a pool stays with its thread

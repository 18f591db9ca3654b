"""The pool at GPU-workstation sizes (issue 10/14): costs that must not grow with the pool.

Three measurements, each a ratio or a figure from one run (no timed tests):

- **step cost**: the same workload (shared-system, 4 users x 2 turns on the tiny model) at a
  small and a large pool (512 vs 500,000 blocks); seconds per engine step = wall time of the
  rounds / forwards. Sizes alternate over `reps` repetitions; the fastest run per size is
  compared (on a shared machine other work only ever adds time; the median is reported too)
  (target: large <= 1.1x small).
- **stats()**: the app's refresh call on the large engine after the workload (target <= 1 ms);
  next to it the app's block map calls: its Mirror's ``summary`` over 1000 cells and ``arrays``
  (every engine here feeds a Mirror from its batches, as the app's does).
- **ready time and RSS at 1,000,000 blocks**: in a fresh interpreter (the model loaded first),
  the time to build the Engine, split into the pool's metadata and the K/V tensor allocation,
  and the resident memory before and after.

``run_scale()`` returns a dict; ``scale_lines(result)`` formats it; ``scale_targets(result)``
gives the bench's Target rows. ``python -m kvplay.bench.scale`` runs it and prints the lines.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.model import load_model
from kvplay.engine.sampling_params import SamplingParams
from kvplay.wire.mirror import Mirror

from .metrics import Target
from .peers import submit_together, warm_up_engine
from .workloads import build_workload

SMALL, LARGE, HUGE = 512, 500_000, 1_000_000
Progress = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _workload(tokenizer):
    return build_workload("shared-system", tokenizer, users=4, turns=2, new_tokens=16)


def play_rounds(engine, workload, clock: Callable[[], float] = time.perf_counter, warm: bool = True) -> tuple[float, int]:
    """Play the workload's rounds (after a warm-up request, unless `warm` is False); returns
    (seconds on `clock`, forwards)."""
    if warm:
        warm_up_engine(engine, workload.turns[0].prompt_ids)
    sampling = SamplingParams(temperature=0.0, max_tokens=workload.new_tokens, stop_on_eos=False)
    f0 = engine.forwards
    t0 = clock()
    for rnd in workload.rounds:
        for h in submit_together(engine, rnd, sampling):
            r = h.result(600)
            if r.error:
                raise RuntimeError(f"request failed: {r.error}")
    return clock() - t0, engine.forwards - f0


def _per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def step_and_stats(loaded, small: int = SMALL, large: int = LARGE, reps: int = 5,
                   progress: Progress = _quiet) -> dict:
    """(a) seconds per step at `small` vs `large` blocks, (b) stats() and block-map call costs."""
    workload = _workload(loaded.tokenizer)
    base = EngineConfig(model=loaded.name)
    per_step: dict[int, list[float]] = {small: [], large: []}
    ready: dict[int, list[float]] = {small: [], large: []}
    calls: dict = {}
    for rep in range(reps):
        for n in (small, large):
            progress(f"scale: step cost, {n:,} blocks, repetition {rep + 1}/{reps}")
            t0 = time.perf_counter()
            engine = Engine(base.replace(num_blocks=n).validate(), loaded)
            mirror = Mirror(n)  # as the app has one: the engine's batches feed it every step
            engine.subscribe_batches(mirror.apply)
            engine.start()
            ready[n].append(time.perf_counter() - t0)
            try:
                wall, forwards = play_rounds(engine, workload)
                per_step[n].append(wall / max(1, forwards))
                if n == large and rep == reps - 1:
                    progress(f"scale: stats() and block-map calls at {n:,} blocks")
                    calls = {
                        "stats_us": _per_call_us(engine.stats, 2000),
                        "stats_nowait_us": _per_call_us(lambda: engine.stats(timeout=0), 2000),
                        "mirror_summary_1000_cells_ms": _per_call_us(lambda: mirror.summary(1000), 20) / 1000,
                        "mirror_arrays_ms": _per_call_us(mirror.arrays, 20) / 1000,
                    }
                    v = engine.stats()
                    calls["blocks_cached"] = v["blocks_cached"]
            finally:
                engine.shutdown()
    med = {n: statistics.median(v) for n, v in per_step.items()}
    best = {n: min(v) for n, v in per_step.items()}
    return {
        "workload": workload.description,
        "small_blocks": small, "large_blocks": large, "reps": reps,
        "step_ms_small": best[small] * 1000, "step_ms_large": best[large] * 1000,
        "step_ratio": best[large] / best[small] if best[small] else None,
        "step_ratio_median": med[large] / med[small] if med[small] else None,
        "step_ms_all": {str(n): [round(x * 1000, 3) for x in v] for n, v in per_step.items()},
        "engine_build_s": {str(n): round(statistics.median(v), 3) for n, v in ready.items()},
        **calls,
    }


_READY_CODE = r"""
import json, resource, sys, time
n = int(sys.argv[1])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
from kvplay.engine.config import EngineConfig
from kvplay.wire.mirror import Mirror
from kvplay.engine.engine import Engine
from kvplay.engine.kv_store import KVStore
from kvplay.engine.model import load_model
from kvplay.engine.pool import BlockPool
from kvplay.engine.runner import kv_geometry
from kvplay.engine.sampling_params import SamplingParams
loaded = load_model("tiny:llama", device="cpu", dtype="float32")
out = {"blocks": n, "rss_before_mb": rss()}
t = time.perf_counter()
eng = Engine(EngineConfig(model="tiny:llama", num_blocks=n), loaded)
out["ready_s"] = time.perf_counter() - t
out["rss_ready_mb"] = rss()
eng.start()
t = time.perf_counter()
eng.generate("alice", [{"role": "user", "content": "hello there, a first message"}],
             SamplingParams(max_tokens=8, stop_on_eos=False), timeout=600)
out["first_request_s"] = time.perf_counter() - t
t = time.perf_counter(); st = eng.stats(); out["stats_us"] = (time.perf_counter() - t) * 1e6
out["rss_after_request_mb"] = rss()
out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
eng.shutdown()
del eng
# the two parts of the build, timed alone (after the RSS figures, so they do not inflate them)
t = time.perf_counter(); BlockPool(n, 16); out["pool_s"] = time.perf_counter() - t
layers, kv_heads, head_dim = kv_geometry(loaded.model)
t = time.perf_counter(); s = KVStore(n, 16, layers, kv_heads, head_dim, loaded.dtype, "cpu")
out["kv_alloc_s"] = time.perf_counter() - t; out["kv_bytes"] = s.total_bytes; del s
print(json.dumps(out))
"""


def ready_at(blocks: int = HUGE, progress: Progress = _quiet) -> dict:
    """(c) ready time and RSS at `blocks`, measured in a fresh interpreter."""
    progress(f"scale: ready time and RSS at {blocks:,} blocks (fresh interpreter)")
    proc = subprocess.run([sys.executable, "-c", _READY_CODE, str(blocks)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"blocks": blocks, "error": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_and_load(loaded=None) -> tuple:
    """(`loaded`, or the tiny model loaded now; the load averages before measuring, or None)."""
    if loaded is None:
        loaded = load_model("tiny:llama", device="cpu", dtype="float32")
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return loaded, load


def run_scale(loaded=None, small: int = SMALL, large: int = LARGE, huge: int = HUGE, reps: int = 5,
              progress: Progress = _quiet) -> dict:
    """All three measurements; `loaded`: the tiny model (loaded here when None)."""
    loaded, load = tiny_and_load(loaded)
    out = {"model": loaded.name, "load_avg_before": load}
    out["step"] = step_and_stats(loaded, small, large, reps, progress)
    out["ready"] = ready_at(huge, progress)
    return out


def scale_targets(result: dict) -> list[Target]:
    s = result.get("step", {})
    return [
        Target(f"step cost at {s.get('large_blocks', LARGE):,} vs {s.get('small_blocks', SMALL)} blocks",
               s.get("step_ratio"), 1.1, True, "fastest of the repetitions, seconds per engine step, same workload"),
        Target(f"stats() at {s.get('large_blocks', LARGE):,} blocks (ms)",
               None if s.get("stats_us") is None else s["stats_us"] / 1000, 1.0, True, "mean of 2000 calls"),
    ]


def scale_lines(result: dict) -> list[str]:
    s, r = result.get("step", {}), result.get("ready", {})
    load = result.get("load_avg_before")
    lines = [f"model {result.get('model')}, load average before {' '.join(map(str, load)) if load else '–'}"]
    if s:
        lines += [
            f"step cost ({s['workload']}): {s['step_ms_small']:.2f} ms at {s['small_blocks']:,} blocks, "
            f"{s['step_ms_large']:.2f} ms at {s['large_blocks']:,} -> {s['step_ratio']:.2f}x "
            f"(fastest of {s['reps']}; medians -> {s['step_ratio_median']:.2f}x; all: "
            + "; ".join(f"{int(n):,}: {', '.join(f'{x:.2f}' for x in v)} ms" for n, v in s["step_ms_all"].items())
            + ")",
            "engine build: " + ", ".join(f"{float(v):.3f} s at {int(n):,} blocks" for n, v in s["engine_build_s"].items()),
        ]
        if "stats_us" in s:
            lines += [
                f"stats() at {s['large_blocks']:,} blocks ({s['blocks_cached']} cached): {s['stats_us']:.1f} us, "
                f"stats(timeout=0) {s['stats_nowait_us']:.1f} us",
                f"the app's mirror: summary(1000 cells) {s['mirror_summary_1000_cells_ms']:.2f} ms, "
                f"arrays() {s['mirror_arrays_ms']:.2f} ms",
            ]
    if r.get("error"):
        lines.append(f"ready at {r['blocks']:,} blocks: failed: {r['error']}")
    elif r:
        lines += [
            f"ready at {r['blocks']:,} blocks: Engine built in {r['ready_s']:.2f} s (pool metadata alone "
            f"{r['pool_s']:.3f} s, K/V tensor allocation {r['kv_alloc_s']:.3f} s for "
            f"{r['kv_bytes'] / 2**30:.1f} GiB); first request {r['first_request_s']:.2f} s",
            f"RSS: {r['rss_before_mb']:.0f} MB with the model loaded, {r['rss_ready_mb']:.0f} MB ready, "
            f"{r['rss_after_request_mb']:.0f} MB after a request (peak {r['peak_rss_mb']:.0f} MB); "
            f"stats() {r['stats_us']:.0f} us",
        ]
    return lines


if __name__ == "__main__":  # pragma: no cover
    res = run_scale(progress=lambda m: print(m, file=sys.stderr, flush=True))
    print("\n".join(scale_lines(res)))
    for t in scale_targets(res):
        print(f"target {t.name}: {t.value} (<= {t.threshold}): {'met' if t.met else 'missed'}")

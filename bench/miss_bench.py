"""What miss attribution (engine/miss.py) costs: the engine step and the simulator with it on and
off, in one process, measured as CPU time (`kvplay bench --workload miss`).

- **engine step**: the tiny model, one engine thread, two workloads from bench/workloads.py
  (shared-system: shared prefixes, divergences, tails; pressure: a pool too small for everyone,
  so evictions and preemptions), played with attribution on and off, alternating over `reps`
  repetitions on the same engine (its cache emptied in between). CPU time of the process per
  engine forward; the best repetition of each side is compared (on a shared machine other work
  only adds time), the medians too. Next to it, the attribution's own CPU time (explain at each
  first admission, and every store and removal it tracks), measured by the engine thread's
  clock around those calls: an upper bound of what the A/B can show.
- **simulate**: the same requests as a trace through sessions/simulate.py (no model: the
  scheduler and pool alone, so the attribution's share is far larger there), attribution on
  and off, alternating, thread CPU time.
"""
from __future__ import annotations

import statistics
import time

from kvplay.engine.config import EngineConfig
from kvplay.engine.engine import Engine
from kvplay.engine.miss import MissTracker
from kvplay.sessions.simulate import Trace, TraceRequest, simulate

from .peers import kvplay_config, warm_up_engine
from .scale import Progress, _quiet, play_rounds, tiny_and_load
from .workloads import build_workload


class _Clock:
    """Sums the engine thread's CPU time inside the tracker's methods (patched in for a run)."""

    NAMES = ("explain", "stored", "removed_blocks")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._orig: dict = {}

    def __enter__(self) -> "_Clock":
        for name in self.NAMES:
            orig = self._orig[name] = getattr(MissTracker, name)

            def timed(*a, _orig=orig, **k):
                t = time.thread_time()
                try:
                    return _orig(*a, **k)
                finally:
                    self.seconds += time.thread_time() - t
                    self.calls += 1
            setattr(MissTracker, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(MissTracker, name, orig)


def engine_ab(loaded, name: str, reps: int = 5, progress: Progress = _quiet) -> dict:
    workload = build_workload(name, loaded.tokenizer, users=4 if name == "shared-system" else None, turns=2,
                              new_tokens=16)
    cfg = kvplay_config(EngineConfig(model=loaded.name, threads=1), workload, False)
    per_step: dict[bool, list[float]] = {True: [], False: []}
    own: list[float] = []
    steps = 0
    with Engine(cfg, loaded) as engine:
        warm_up_engine(engine, workload.turns[0].prompt_ids)
        for rep in range(reps):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                progress(f"miss: engine, {name}, attribution {'on' if on else 'off'}, repetition {rep + 1}/{reps}")
                engine.set_miss_attribution(on)
                engine.clear_cache()
                with _Clock() as clock:
                    cpu, forwards = play_rounds(engine, workload, time.process_time, warm=False)
                per_step[on].append(cpu / max(1, forwards))
                if on:
                    own.append(clock.seconds / max(1, forwards))
                    steps = forwards
    best = {k: min(v) for k, v in per_step.items()}
    med = {k: statistics.median(v) for k, v in per_step.items()}
    return {
        "workload": workload.description, "steps": steps, "reps": reps,
        "step_ms_on": best[True] * 1000, "step_ms_off": best[False] * 1000,
        "ratio": best[True] / best[False], "ratio_median": med[True] / med[False],
        "attribution_ms_per_step": min(own) * 1000,
        "attribution_share": min(own) / best[False],
        "step_ms_all": {"on": [round(x * 1000, 3) for x in per_step[True]],
                        "off": [round(x * 1000, 3) for x in per_step[False]]},
    }


def simulate_ab(loaded, name: str, reps: int = 5, progress: Progress = _quiet) -> dict:
    workload = build_workload(name, loaded.tokenizer, users=4 if name == "shared-system" else None, turns=2,
                              new_tokens=16)
    cfg = kvplay_config(EngineConfig(model=loaded.name), workload, False)
    if cfg.num_blocks is None:
        cfg = cfg.replace(num_blocks=4096)
    reqs = [TraceRequest(f"r{i}", t.user, list(t.prompt_ids), list(range(100, 116)), system_tokens=t.system_tokens)
            for i, t in enumerate(workload.turns)]
    trace = Trace(cfg, loaded.name, reqs, source=f"bench {name}")
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            progress(f"miss: simulate, {name}, attribution {'on' if on else 'off'}, repetition {rep + 1}/{reps}")
            t = time.thread_time()
            res = simulate(trace, attribution=on)
            cpu[on].append(time.thread_time() - t)
    best = {k: min(v) for k, v in cpu.items()}
    return {"workload": workload.description, "requests": len(reqs), "reps": reps,
            "ms_on": best[True] * 1000, "ms_off": best[False] * 1000, "ratio": best[True] / best[False],
            "ratio_median": statistics.median(cpu[True]) / statistics.median(cpu[False]),
            "hit_rate": round(res.hit_rate, 4)}


def run(loaded=None, reps: int = 5, progress: Progress = _quiet) -> dict:
    """Both measurements on both workloads; `loaded`: the tiny model (loaded here when None)."""
    loaded, load = tiny_and_load(loaded)
    out = {"model": loaded.name, "load_avg_before": load, "engine": {}, "simulate": {}}
    for name in ("shared-system", "pressure"):
        out["engine"][name] = engine_ab(loaded, name, reps, progress)
        out["simulate"][name] = simulate_ab(loaded, name, reps, progress)
    return out


def lines(r: dict) -> list[str]:
    load = r.get("load_avg_before")
    out = [f"miss attribution on vs off, {r['model']}, one process, CPU time; load average before "
           f"{' '.join(map(str, load)) if load else '–'}"]
    for name, e in r["engine"].items():
        out.append(f"engine step, {name} ({e['workload']}, {e['steps']} steps): {e['step_ms_on']:.3f} ms on vs "
                   f"{e['step_ms_off']:.3f} ms off -> {e['ratio']:.3f}x (medians {e['ratio_median']:.3f}x; best of "
                   f"{e['reps']}); the attribution itself {e['attribution_ms_per_step'] * 1000:.1f} us a step "
                   f"({e['attribution_share']:.2%} of a step)")
    for name, s in r["simulate"].items():
        out.append(f"simulate, {name} ({s['requests']} requests): {s['ms_on']:.1f} ms on vs {s['ms_off']:.1f} ms off "
                   f"-> {s['ratio']:.3f}x (medians {s['ratio_median']:.3f}x)")
    return out


def print_report(r: dict) -> None:
    print("\n".join(lines(r)))

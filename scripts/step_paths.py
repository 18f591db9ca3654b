#!/usr/bin/env python
"""One engine step's forward on the embedded model, the ways kvplay can run it: plain weights
(F.linear / skinny_mm) against oneDNN's packed weights (engine/packed.py), a step's decode
rows and prompt chunk as two forwards against one (engine/scheduler.py), decode rows that
share prefix blocks attended row by row against once per group (engine/cascade.py), every row
attended by the compiled kernels (engine/native.py: decode rows, prompt chunks), and the work
between the GEMMs in compiled passes too (norms, rotary + K/V write, SiLU: the default).

    .venv/bin/python scripts/step_paths.py [--threads 1] [--reps 7] [--shared-only]
    .venv/bin/python scripts/step_paths.py --prefill 540 --budget 256,544 [--deterministic]

Each case runs the paths in turn, `--reps` times, and keeps each path's best time; at one thread
it reads the thread's CPU time (what the step costs, even on a machine other jobs share), at more
threads wall time (a busy machine makes that loose: say so when you quote it). Rows are decode
rows at 420 tokens of context and a prompt chunk after 384 cached tokens, the shape of
`scripts/serve_compare.py`'s workload. "/ S blocks x P prefixes" cases: every decode row's first
S blocks are one of P prefixes' (as the prefix cache hands them out), then 3 blocks of its own.

`--prefill N`: a cold prompt of N tokens (nothing cached), computed in chunks of each `--budget`
as the scheduler would (one forward a chunk), on the packed paths; `--deterministic` runs the
deterministic mode's forward (its torch path: exact per-query SDPA and torch's element-wise ops,
against the compiled one). `--profile` adds where that prompt's time goes on the torch path and
on the default (compiled) one, by torch.profiler: GEMMs, attention, the element-wise ops (norms,
rotary and the K/V write, SiLU x up, residual adds), the rest (embedding, rotary tables, lm_head
rows, Python).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvplay.engine import native
from kvplay.engine.heap import keep_freed_memory
from kvplay.engine.model import ensure_converted, load_model
from kvplay.engine.runner import ModelRunner, Row

# (decode rows, chunk tokens, shared prefix blocks, prefixes)
CASES = [(1, 0, 0, 0), (4, 0, 0, 0), (8, 0, 0, 0), (8, 48, 0, 0), (16, 0, 0, 0), (32, 0, 0, 0),
         (0, 256, 0, 0), (8, 248, 0, 0)]
SHARED = [(8, 0, 24, 1), (8, 0, 24, 4), (32, 0, 24, 1), (32, 0, 24, 4), (8, 48, 24, 4)]


def rows(decode: int, chunk: int, shared: int = 0, prefixes: int = 0) -> tuple[list[Row], list[Row]]:
    dec, nb = [], shared * prefixes
    for i in range(decode):
        if shared:  # the prefix's blocks, then its own (the prefix cache's shape)
            first = (i % prefixes) * shared
            dec.append(Row(list(range(first, first + shared)) + list(range(nb, nb + 28 - shared)), 420, [100 + i]))
            nb += 28 - shared
            continue
        dec.append(Row(list(range(nb, nb + 28)), 420, [100 + i]))
        nb += 28
    pre = [Row(list(range(nb, nb + 40)), 384, list(range(200, 200 + chunk)))] if chunk else []
    return dec, pre


def runners(loaded) -> dict[str, ModelRunner]:
    def make(**kw):
        return ModelRunner(loaded, 2048, 16, **kw)
    return {
        "plain": make(packed=False, cascade=False, native=False, fused=False),
        "packed": make(packed=True, cascade=False, native=False, fused=False),
        "cascade": make(packed=True, cascade=True, native=False, fused=False),
        "kernel": make(packed=True, cascade=False, native=True, fused=False),
        "fused": make(packed=True, cascade=False, native=True, fused=True),
    }


def best_of(paths: dict, reps: int, clock) -> dict[str, float]:
    """Each path's best time in ms over `reps` rounds, the paths interleaved in every round."""
    best = {k: float("inf") for k in paths}
    for fn in paths.values():  # once untimed: the first call of a shape builds oneDNN's kernels
        fn()
    for _ in range(reps):
        for k, fn in paths.items():
            t0 = clock()
            fn()
            best[k] = min(best[k], clock() - t0)
    return {k: v * 1000 for k, v in best.items()}


def steps(run: dict[str, ModelRunner], args, clock) -> None:
    paths = {
        "plain, 2 forwards": lambda d, p: [run["plain"].forward(x) for x in (d, p) if x],
        "plain, 1 forward": lambda d, p: run["plain"].forward(d + p),
        "packed, 1 forward": lambda d, p: run["packed"].forward(d + p),
        "packed + cascade": lambda d, p: run["cascade"].forward(d + p),
        "packed + kernels": lambda d, p: run["kernel"].forward(d + p),
        "packed + kernels + fused": lambda d, p: run["fused"].forward(d + p),
    }
    print("| decode rows + chunk tokens | " + " | ".join(paths)
          + " | packed 1 fwd vs plain 2 fwd | cascade vs packed | kernels vs cascade | fused vs kernels |")
    print("|---" * (len(paths) + 5) + "|")
    for d, c, shared, prefixes in (SHARED if args.shared_only else CASES + SHARED):
        dec, pre = rows(d, c, shared, prefixes)
        ms = best_of({k: (lambda fn=fn: fn(dec, pre)) for k, fn in paths.items()}, args.reps, clock)
        v = list(ms.values())
        case = f"{d} + {c}" + (f" / {shared} blocks x {prefixes}" if shared else "")
        print(f"| {case} | " + " | ".join(f"{x:.1f}" for x in v)
              + f" | {v[0] / v[2]:.2f}x | {v[2] / v[3]:.2f}x | {v[3] / v[4]:.2f}x | {v[4] / v[5]:.2f}x |", flush=True)


def prefill(run: dict[str, ModelRunner], args, clock) -> None:
    n = args.prefill
    ids = [(i * 37) % 40000 + 10 for i in range(n)]
    blocks = list(range((n + 15) // 16))

    def cold(runner: ModelRunner, budget: int):
        def go():
            p = 0
            while p < n:
                k = min(budget, n - p)
                runner.forward([Row(blocks, p, ids[p:p + k])], args.deterministic)
                p += k
        return go
    if args.profile:
        where_time_goes(run, lambda runner: cold(runner, args.budget[0]), clock)
    names = {"packed": "packed, torch attention", "kernel": "packed + kernels", "fused": "packed + kernels + fused"}
    mode = "deterministic" if args.deterministic else "default"
    print(f"cold prompt of {n} tokens, {mode} mode")
    print("| prefill budget | " + " | ".join(names.values()) + " | kernels vs torch | all vs torch |")
    print("|---" * (len(names) + 3) + "|")
    for budget in args.budget:
        ms = best_of({k: cold(run[k], budget) for k in names}, args.reps, clock)
        v = list(ms.values())
        print(f"| {budget} ({-(-n // budget)} chunks) | " + " | ".join(f"{x:.1f}" for x in v)
              + f" | {v[0] / v[1]:.2f}x | {v[0] / v[2]:.2f}x |", flush=True)


# torch.profiler event names -> the part of a forward they are (the compiled calls are named by
# `_named`, since the profiler does not see into ctypes calls)
PARTS = [("GEMM", ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::linear")),
         ("attention", ("flash_attention", "kvplay::attention", "scaled_dot_product")),
         ("norms", ("rms_norm", "kvplay::rms_norm", "aten::pow", "aten::mean", "aten::rsqrt")),
         ("rotary + K/V write", ("kvplay::rope_write", "aten::roll", "aten::index_copy_", "aten::cos", "aten::sin")),
         ("SiLU x up", ("aten::silu", "kvplay::silu_mul")),
         ("adds, muls, copies", ("aten::add", "aten::mul", "aten::cat", "aten::copy_", "aten::contiguous"))]


def _named(name: str, fn):
    def call(*args, **kw):
        with record_function(name):
            return fn(*args, **kw)
    return call


def where_time_goes(run: dict[str, ModelRunner], prompt, clock) -> None:
    """One cold prompt on the torch path and on the default one, by part (ms of CPU time a part's
    own ops took; `the rest`: the forward's time not in them)."""
    saved = {k: getattr(native, k) for k in ("rms_norm", "silu_mul", "rope_write", "decode_attention",
                                             "prefill_attention")}
    for k, fn in saved.items():
        setattr(native, k, _named(f"kvplay::{'attention' if k.endswith('attention') else k}", fn))
    try:
        print("| part | torch ops (--no-native-attention --no-fused-ops) | compiled (the default) |")
        print("|---|---|---|")
        got = {}
        for key in ("packed", "fused"):
            prompt(run[key])()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = clock()
                prompt(run[key])()
                total = (clock() - t0) * 1000
            parts = collections.Counter()
            for ev in prof.key_averages():
                for part, names in PARTS:
                    if any(n in ev.key for n in names):
                        parts[part] += ev.self_cpu_time_total / 1000
                        break
            parts["the rest"] = total - sum(parts.values())
            got[key] = (parts, total)
        for part in [p for p, _ in PARTS] + ["the rest"]:
            cells = [f"{got[k][0][part]:.0f} ms ({100 * got[k][0][part] / got[k][1]:.0f} %)" for k in ("packed", "fused")]
            print(f"| {part} | " + " | ".join(cells) + " |")
        print(f"| total | {got['packed'][1]:.0f} ms | {got['fused'][1]:.0f} ms |", flush=True)
    finally:
        for k, fn in saved.items():
            setattr(native, k, fn)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shared-only", action="store_true", help="only the shared-prefix cases")
    ap.add_argument("--prefill", type=int, default=0, help="time a cold prompt of this many tokens instead")
    ap.add_argument("--budget", default="256", help="--prefill: chunk sizes, comma-separated")
    ap.add_argument("--deterministic", action="store_true", help="--prefill: deterministic mode's forward")
    ap.add_argument("--profile", action="store_true", help="--prefill: where the time goes (first budget)")
    args = ap.parse_args()
    try:
        args.budget = [int(b) for b in args.budget.split(",")]
    except ValueError:
        args.budget = []
    if args.threads < 1 or args.reps < 1 or args.prefill < 0 or not args.budget or min(args.budget) < 1:
        print("step_paths: --threads, --reps and --budget take positive integers", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as an Engine does: a step's freed activations stay in the heap (heap.py)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    loaded = load_model(str(ensure_converted()))
    run = runners(loaded)
    if not run["fused"].native or not run["fused"].fused:
        print(f"step_paths: no compiled kernels ({native.why_not()})", file=sys.stderr)
        return 2
    if not run["packed"].llama_step or not run["packed"].llama_step.packed:
        print("step_paths: this torch cannot pack weights for oneDNN", file=sys.stderr)
        return 2
    print(f"{args.threads} thread(s), best of {args.reps}, "
          f"{'thread CPU' if args.threads == 1 else 'wall'} ms per {'prompt' if args.prefill else 'step'}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.prefill:
        prefill(run, args, clock)
    else:
        steps(run, args, clock)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""One engine step's forward on the embedded model, the ways kvplay can run it: plain weights
(F.linear / skinny_mm) against oneDNN's packed weights (engine/packed.py), a step's decode
rows and prompt chunk as two forwards against one (engine/scheduler.py), and decode rows that
share prefix blocks attended row by row against once per group (engine/cascade.py), and every
decode row attended by the compiled kernel (engine/native.py).

    .venv/bin/python scripts/step_paths.py [--threads 1] [--reps 7] [--shared-only]

Each case runs the paths in turn, `--reps` times, and keeps each path's best time; at one thread
it reads the thread's CPU time (what the step costs, even on a machine other jobs share), at more
threads wall time (a busy machine makes that loose: say so when you quote it). Rows are decode
rows at 420 tokens of context and a prompt chunk after 384 cached tokens, the shape of
`scripts/serve_compare.py`'s workload. "/ S blocks x P prefixes" cases: every decode row's first
S blocks are one of P prefixes' (as the prefix cache hands them out), then 3 blocks of its own.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvplay.engine import native
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shared-only", action="store_true", help="only the shared-prefix cases")
    args = ap.parse_args()
    if args.threads < 1 or args.reps < 1:
        print("step_paths: --threads and --reps take positive integers", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    loaded = load_model(str(ensure_converted()))
    plain = ModelRunner(loaded, 2048, 16, packed=False, cascade=False, native=False)
    packed = ModelRunner(loaded, 2048, 16, packed=True, cascade=False, native=False)
    cascaded = ModelRunner(loaded, 2048, 16, packed=True, cascade=True, native=False)
    compiled = ModelRunner(loaded, 2048, 16, packed=True, cascade=False, native=True)
    if not compiled.native:
        print(f"step_paths: no compiled kernel ({native.why_not()})", file=sys.stderr)
        return 2
    if not packed.llama_step or not packed.llama_step.packed:
        print("step_paths: this torch cannot pack weights for oneDNN", file=sys.stderr)
        return 2
    paths = {
        "plain, 2 forwards": lambda d, p: [plain.forward(x) for x in (d, p) if x],
        "plain, 1 forward": lambda d, p: plain.forward(d + p),
        "packed, 1 forward": lambda d, p: packed.forward(d + p),
        "packed + cascade": lambda d, p: cascaded.forward(d + p),
        "packed + kernel": lambda d, p: compiled.forward(d + p),
    }
    print(f"{args.threads} thread(s), best of {args.reps}, "
          f"{'thread CPU' if args.threads == 1 else 'wall'} ms per step; load average {os.getloadavg()[0]:.1f}")
    print("| decode rows + chunk tokens | " + " | ".join(paths)
          + " | packed 1 fwd vs plain 2 fwd | cascade vs packed | kernel vs cascade |")
    print("|---" * (len(paths) + 4) + "|")
    for d, c, shared, prefixes in (SHARED if args.shared_only else CASES + SHARED):
        dec, pre = rows(d, c, shared, prefixes)
        best = {k: float("inf") for k in paths}
        for fn in paths.values():  # once untimed: the first call of a shape builds oneDNN's kernels
            fn(dec, pre)
        for _ in range(args.reps):
            for k, fn in paths.items():
                t0 = clock()
                fn(dec, pre)
                best[k] = min(best[k], clock() - t0)
        ms = {k: v * 1000 for k, v in best.items()}
        case = f"{d} + {c}" + (f" / {shared} blocks x {prefixes}" if shared else "")
        print(f"| {case} | " + " | ".join(f"{v:.1f}" for v in ms.values())
              + f" | {ms['plain, 2 forwards'] / ms['packed, 1 forward']:.2f}x"
              + f" | {ms['packed, 1 forward'] / ms['packed + cascade']:.2f}x"
              + f" | {ms['packed + cascade'] / ms['packed + kernel']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""How often the audit's intervals miss 0.5 when hits and misses time alike (no cache at all).

Draws `--runs` null runs of `--probes` + `--probes` times (log-normal, the same law for both
kinds), and counts the runs whose AP interval (labs/stats.ap_ci) and ROC AUC interval
(labs/stats.auc_ci) exclude 0.5, at `--level`; prints the mean AP under the null too (chance for
AP is above 0.5 in small samples). docs/audit.md quotes this script's output.

    .venv/bin/python scripts/interval_null.py [--runs 400] [--probes 30] [--level 0.95] [--seed 0]
"""
from __future__ import annotations

import argparse

import numpy as np

from kvplay.labs import stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--probes", type=int, default=30)
    ap.add_argument("--level", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    off_ap = off_auc = 0
    aps = []
    for i in range(a.runs):
        hit, miss = rng.lognormal(0, 0.3, a.probes), rng.lognormal(0, 0.3, a.probes)
        v, lo, hi = stats.ap_ci([-x for x in hit], [-x for x in miss], level=a.level, seed=i)
        aps.append(v)
        off_ap += not lo <= 0.5 <= hi
        _, lo, hi = stats.auc_ci(miss, hit, level=a.level, seed=i)
        off_auc += not lo <= 0.5 <= hi
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{a.runs} runs", flush=True)
    n = a.runs
    print(f"{n} null runs of {a.probes} + {a.probes} probes, {a.level:.0%} intervals:")
    print(f"  AP interval misses 0.5 in {off_ap} ({off_ap / n:.1%}); mean AP {np.mean(aps):.3f}")
    print(f"  ROC AUC interval misses 0.5 in {off_auc} ({off_auc / n:.1%}); nominal {1 - a.level:.1%}")


if __name__ == "__main__":
    main()

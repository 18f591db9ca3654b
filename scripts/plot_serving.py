#!/usr/bin/env python
"""The serving table as a picture: kvplay's speed as a ratio of vLLM's, from the JSON files
`scripts/serve_compare.py --json` writes.

    .venv/bin/python scripts/plot_serving.py equal.json [defaults.json ...] -o docs/serving.png

One row of panels per file (equal running limits, or each server at its defaults: the file says
which), one panel per metric (TTFT p50, ITL p50, output tok/s), concurrency on the x axis, one
series per thread count. A point is the ratio of the medians (≥ 1: kvplay faster; vLLM ms ÷
kvplay ms for latencies, kvplay ÷ vLLM for tok/s), its bar the range of the per-round ratios
(`--repeat`'s rounds), the dashed line 1.0. A file in another shape is one line and exit 2.
"""
from __future__ import annotations

import math
import re
import sys

from kvplay.options import KvplayError, plot_files_main, read_json_file

METRICS = (("ttft", "TTFT p50"), ("itl", "ITL p50"), ("tok_s", "output tok/s"))
WHEN = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d(:\d\d)? UTC")


class FormatError(KvplayError):
    """A file that is not what serve_compare.py --json writes."""


def _int(v, what: str, path: str, lo: int = 1) -> int:
    if type(v) is not int or v < lo:
        raise FormatError(f"{path}: {what} must be an integer ≥ {lo}, not {v!r}"[:200])
    return v


def _ratio(v, what: str, path: str) -> float | None:
    """A ratio, or None where serve_compare had no figure to divide (a zero)."""
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
        raise FormatError(f"{path}: {what} must be a positive number or null, not {v!r}"[:200])
    return float(v)


def load(path: str) -> dict:
    """One serve_compare.py --json file, checked, as {"limit": max_num_seqs or None, "when": str,
    "rows": {(threads, concurrency): {metric: (ratio, lo, hi)}}}."""
    doc = read_json_file(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or not doc["runs"]:
        raise FormatError(f"{path}: not a serve_compare.py --json file (no list of runs)")
    when = doc.get("when")
    if not isinstance(when, str) or not WHEN.fullmatch(when):
        raise FormatError(f"{path}: 'when' must read like '2026-01-31 12:00:00 UTC'")
    rows: dict = {}
    limit = "unset"
    for i, r in enumerate(doc["runs"]):
        at = f"runs[{i}]"
        if not isinstance(r, dict):
            raise FormatError(f"{path}: {at} is not an object")
        key = (_int(r.get("threads"), f"{at}.threads", path), _int(r.get("concurrency"), f"{at}.concurrency", path))
        if key in rows:
            raise FormatError(f"{path}: {at}: threads {key[0]}, concurrency {key[1]} appears twice")
        lim = r.get("max_num_seqs")
        lim = None if lim is None else _int(lim, f"{at}.max_num_seqs", path)
        if limit != "unset" and lim != limit:
            raise FormatError(f"{path}: {at}: running limits differ between rows ({limit} and {lim})")
        limit = lim
        ratio, spread = r.get("ratio"), r.get("ratio_range")
        if not isinstance(ratio, dict) or not isinstance(spread, dict):
            raise FormatError(f"{path}: {at} has no 'ratio' and 'ratio_range' objects")
        got = {}
        for m, _ in METRICS:
            mid = _ratio(ratio.get(m), f"{at}.ratio.{m}", path)
            rng = spread.get(m)
            if not isinstance(rng, list) or len(rng) != 2:
                raise FormatError(f"{path}: {at}.ratio_range.{m} must be a [min, max] pair")
            lo, hi = (_ratio(x, f"{at}.ratio_range.{m}", path) for x in rng)
            if (lo is None) != (hi is None) or (lo is not None and lo > hi):
                raise FormatError(f"{path}: {at}.ratio_range.{m} must be [min, max] with min ≤ max")
            got[m] = (mid, lo, hi)
        rows[key] = got
    return {"limit": limit, "when": when, "rows": rows}


def title(table: dict) -> str:
    """What a file measured, from its numbers only (no text of the file reaches the figure but
    its checked time stamp)."""
    lim = table["limit"]
    return f"equal limits ({lim} running)" if lim else "each at its defaults"


def figure(tables: list[dict], plt):
    """The figure: a row of metric panels per table."""
    fig, axes = plt.subplots(len(tables), len(METRICS), figsize=(5 * len(METRICS), 3.6 * len(tables)),
                             squeeze=False)
    for row, t in zip(axes, tables):
        row[0].set_ylabel(f"kvplay ÷ vLLM (≥ 1: kvplay faster)\nmeasured {t['when']}", fontsize=9)
        threads = sorted({th for th, _ in t["rows"]})
        concs = sorted({c for _, c in t["rows"]})
        width = 0.7 / max(1, len(threads))
        for ax, (m, name) in zip(row, METRICS):
            for j, th in enumerate(threads):
                xs, ys, lo, hi = [], [], [], []
                for i, c in enumerate(concs):
                    cell = t["rows"].get((th, c))
                    if cell is None or cell[m][0] is None:
                        continue
                    mid, a, b = cell[m]
                    a, b = (mid, mid) if a is None else (a, b)
                    xs.append(i + (j - (len(threads) - 1) / 2) * width)
                    ys.append(mid)
                    lo.append(max(0.0, mid - a))  # a median outside its rounds' range draws no bar
                    hi.append(max(0.0, b - mid))
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=4, label=f"{th} thread{'s' * (th > 1)}")
            ax.axhline(1.0, color="grey", ls="--", lw=1)
            ax.set_xticks(range(len(concs)), [str(c) for c in concs])
            ax.set_xlim(-0.6, len(concs) - 0.4)
            ax.set_xlabel("concurrent clients")
            ax.set_title(f"{name} · {title(t)}", fontsize=10)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    return plot_files_main("scripts/plot_serving.py", __doc__.split("\n\n")[0], "serve_compare.py --json outputs", load, figure, argv)


if __name__ == "__main__":
    sys.exit(main())

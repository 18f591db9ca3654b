#!/usr/bin/env python
"""The labs' verdicts as a picture, from the JSON files `kvplay lab NAME --json` writes.

    .venv/bin/python scripts/plot_labs.py leak.json determinism.json collide.json response-cache.json -o docs/labs.png

One panel per file, each statistic the verdict rests on with its 95 % interval:
- leak: the attacker's ROC AUC per isolation and shared blocks (controls and mitigations too);
  the dashed line 0.5 is chance;
- determinism: per mode and kind of run, the share of runs whose greedy answer changed against a
  cold cache (the claim) and the share whose logits were bitwise equal (Clopper-Pearson);
- collide: colliding pairs measured ÷ the birthday bound (exact Poisson interval); the dashed
  line 1.0 is the bound;
- response-cache: the share of later users served the first user's answer by the response cache,
  and the share of KV-cache answers equal to the user's own seed on a cold cache.
The local labs' files, and `kvplay lab leak --target URL --json`'s. A file in another shape is
one line and exit 2.
"""
from __future__ import annotations

import math
import sys

from kvplay.engine.config import ISOLATION_MODES
from kvplay.options import KvplayError, plot_files_main, read_json_file

MAX_ROWS = 64  # a panel's statistics; a lab writes at most a few dozen
ISOLATIONS = ISOLATION_MODES + ("cache_salt per user",)  # the last: `kvplay lab leak --target URL`'s salted rows


class FormatError(KvplayError):
    """A file that is not what `kvplay lab NAME --json` writes."""


def _num(v, what: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise FormatError(f"{what} must be a number in [{lo:g}, {hi:g}], not {v!r}"[:200])
    return float(v)


def _count(v, what: str) -> int:
    if type(v) is not int or v < 0:
        raise FormatError(f"{what} must be a count (an integer ≥ 0), not {v!r}"[:200])
    return v


def _interval(v, what: str, lo: float = 0.0, hi: float = 1.0) -> tuple[float, float]:
    if not isinstance(v, list) or len(v) != 2:
        raise FormatError(f"{what} must be a [low, high] pair")
    a, b = _num(v[0], what, lo, hi), _num(v[1], what, lo, hi)
    if a > b:
        raise FormatError(f"{what} must be [low, high] with low ≤ high")
    return a, b


def _obj(v, what: str) -> dict:
    if not isinstance(v, dict):
        raise FormatError(f"{what} must be an object")
    return v


def _list(v, what: str) -> list:
    if not isinstance(v, list) or len(v) > MAX_ROWS:
        raise FormatError(f"{what} must be a list of at most {MAX_ROWS}")
    return v


def _one_of(v, what: str, allowed) -> str:
    if v not in allowed:
        raise FormatError(f"{what} must be one of {', '.join(allowed)}, not {v!r}"[:200])
    return v


# Each reader returns (title, x label, reference line or None, x range, rows); a row is
# (label, estimate, low, high, marker). Labels are built from checked values only.

def leak(d: dict):
    rows = []
    for i, r in enumerate(_list(d.get("results"), "data.results") + _list(d.get("mitigations"), "data.mitigations")):
        r = _obj(r, f"data.results[{i}]")
        iso = _one_of(r.get("isolation"), "isolation", ISOLATIONS)
        blocks = _count(r.get("blocks"), "blocks")
        what = _one_of(r.get("probes", "content"), "probes", ("content", "control"))
        mit = _one_of(r.get("mitigation", "none"), "mitigation", ("none", "delay", "pad"))
        label = f"{iso}, {blocks} block{'s' * (blocks != 1)}" + (", A/A control" if what == "control" else "") \
            + ("" if mit == "none" else f", {mit}")
        auc = _num(r.get("auc"), "auc", 0, 1)
        lo, hi = _interval([r.get("auc_lo"), r.get("auc_hi")], "auc_lo, auc_hi")
        rows.append((label, auc, lo, hi, "o"))
    return "leak: the attacker's ROC AUC", "ROC AUC (95 % CI); 0.5 = chance", 0.5, (0, 1.02), rows


def determinism(d: dict):
    rows = []
    modes = _obj(_obj(d.get("summary"), "data.summary").get("modes"), "data.summary.modes")
    for mode, m in modes.items():
        mode = _one_of(mode, "mode", ("default", "deterministic"))
        for kind, k in _obj(_obj(m, f"modes.{mode}").get("by_kind"), f"modes.{mode}.by_kind").items():
            kind = _one_of(kind, "kind", ("cold again", "warm", "batch"))
            k = _obj(k, f"by_kind.{kind}")
            n = _count(k.get("n"), "n")
            if not n:
                continue
            for key, ci, what, marker in (("diverged", "diverged_ci", "answer changed", "o"),
                                          ("bitwise", "bitwise_ci", "logits bitwise equal", "s")):
                got = _count(k.get(key), key)
                if got > n:
                    raise FormatError(f"{key} {got} is more than n {n}")
                lo, hi = _interval(k.get(ci), ci)
                rows.append((f"{mode}, {kind}: {what} ({got}/{n})", got / n, lo, hi, marker))
    return ("determinism: runs against a cold cache", "share of runs (95 % Clopper-Pearson)", None, (-0.02, 1.02),
            rows)


def collide(d: dict):
    rows = []
    for name, key, what in (("offline", "pairs", "random blocks hashed offline"),
                            ("feed", "predicted", "prompts through the engine")):
        x = _obj(d.get(name), f"data.{name}")
        got, expected = _count(x.get(key), key), _num(x.get("expected"), "expected", 0)
        if expected <= 0:
            raise FormatError("expected must be above 0")
        lo, hi = _interval(x.get("ci"), f"data.{name}.ci", 0, math.inf)
        rows.append((f"{what}: {got} colliding vs {expected:.3g} expected", got / expected, lo / expected,
                     hi / expected, "o"))
    return ("collide: measured ÷ birthday bound", "collisions ÷ bound (95 % Poisson); 1.0 = the bound", 1.0,
            None, rows)


def response_cache(d: dict):
    s = _obj(d.get("summary"), "data.summary")
    users = _list(s.get("users"), "users")
    if len(users) < 2:
        raise FormatError("summary.users must name at least two users")
    eq = _list(s.get("kv_equals_cold"), "kv_equals_cold")
    if len(eq) != len(users) or any(type(e) is not bool for e in eq):
        raise FormatError("summary.kv_equals_cold must be one true/false per user")
    texts = _list(s.get("response_cache_texts"), "response_cache_texts")
    if len(texts) != len(users) or any(not isinstance(t, str) for t in texts):
        raise FormatError("summary.response_cache_texts must be one text per user")
    got_first = sum(t == texts[0] for t in texts[1:])
    rows = []
    for k, n, ci, what in ((got_first, len(users) - 1, "response_cache_got_first_ci",
                            "response cache: later users given the first answer"),
                           (sum(eq), len(users), "kv_equals_cold_ci", "KV prefix cache: answer = own seed, cold")):
        lo, hi = _interval(s.get(ci), ci)
        rows.append((f"{what} ({k}/{n})", k / n, lo, hi, "o"))
    return "response-cache: who got whose answer", "share of users (95 % Clopper-Pearson)", None, (-0.02, 1.02), rows


READERS = {"leak": leak, "determinism": determinism, "collide": collide, "response-cache": response_cache}


def load(path: str):
    """One `kvplay lab NAME --json` file, checked, as a panel (title, x label, reference, x range, rows)."""
    doc = read_json_file(path)
    if not isinstance(doc, dict) or doc.get("lab") not in READERS or not isinstance(doc.get("data"), dict):
        raise FormatError(f"{path}: not a `kvplay lab NAME --json` file of a lab this draws "
                          f"({', '.join(READERS)})")
    try:
        panel = READERS[doc["lab"]](doc["data"])
    except FormatError as exc:
        raise FormatError(f"{path}: {exc}") from None
    if not panel[4]:
        raise FormatError(f"{path}: no measurement to draw")
    return panel


def figure(panels: list, plt):
    heights = [max(2, len(p[4])) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.9 + 0.36 * sum(heights) + 0.9 * len(panels)),
                             squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, (name, xlabel, ref, xlim, rows) in zip(axes[:, 0], panels):
        ys = range(len(rows))
        for y, (_, est, lo, hi, marker) in zip(ys, rows):
            ax.errorbar([est], [y], xerr=[[max(0.0, est - lo)], [max(0.0, hi - est)]], fmt=marker, capsize=3,
                        color="tab:blue" if marker == "o" else "tab:green")
        if ref is not None:
            ax.axvline(ref, color="grey", ls="--", lw=1)
        ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
        ax.invert_yaxis()
        if xlim:
            ax.set_xlim(*xlim)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_title(name, fontsize=10, loc="left")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    return plot_files_main("scripts/plot_labs.py", __doc__.split("\n\n")[0], "`kvplay lab NAME --json` outputs", load, figure, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The statistics behind every lab verdict: intervals, tests, sample sizes and the words they allow.

- ``auc`` / ``auc_ci``: ROC AUC of two samples (P(a random positive scores above a random
  negative), ties one half) with a stratified percentile bootstrap interval;
- ``auc_halfwidth`` / ``samples_for_auc``: the Hanley-McNeil normal approximation, to size a run
  before doing it (the bootstrap is what is reported after);
- ``ks_less``: one-sided two-sample Kolmogorov-Smirnov test (scipy), H1: ``x`` tends to be smaller;
- ``clopper_pearson``: exact binomial interval for k of n;
- ``poisson_ci``: exact (Garwood) interval for a count, to put a measured count of collisions
  next to the birthday bound;
- ``leak_call``: "leak", "no evidence of a leak" or "inconclusive" from an AUC interval.

Every random choice takes a seed, so a lab's JSON is reproducible.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import stats as _st

LEVEL = 0.95
N_BOOT = 2000
LEAK_HALFWIDTH = 0.08  # the leak lab's default sample size aims at AUC ± this at 95 %
NEGLIGIBLE = 0.15  # "no evidence of a leak": the whole interval within 0.5 ± this


def _z(level: float) -> float:
    return float(_st.norm.ppf(0.5 + level / 2))


def _auc_rows(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """AUC of every row pair (pos[i], neg[i]) by ranks (Mann-Whitney U), ties one half."""
    n1, n2 = pos.shape[-1], neg.shape[-1]
    ranks = _st.rankdata(np.concatenate([pos, neg], axis=-1), axis=-1)
    u = ranks[..., :n1].sum(axis=-1) - n1 * (n1 + 1) / 2
    return u / (n1 * n2)


def auc(pos, neg) -> float:
    """P(score of a random positive > a random negative), ties count one half; nan if one is empty."""
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    return float(_auc_rows(np.asarray(pos, float), np.asarray(neg, float)))


def auc_ci(pos, neg, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """(AUC, low, high): stratified percentile bootstrap (positives and negatives resampled apart,
    so every resample keeps both sample sizes)."""
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    a = auc(pos, neg)
    if not math.isfinite(a) or len(pos) < 2 or len(neg) < 2:
        return a, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = []
    chunk = max(1, 4_000_000 // (len(pos) + len(neg)))  # bound the memory of one ranking
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        boots.append(_auc_rows(pos[rng.integers(0, len(pos), (b, len(pos)))],
                               neg[rng.integers(0, len(neg), (b, len(neg)))]))
    lo, hi = np.quantile(np.concatenate(boots), [(1 - level) / 2, (1 + level) / 2])
    return a, float(lo), float(hi)


def auc_halfwidth(n_pos: int, n_neg: int, a: float = 0.5, level: float = LEVEL) -> float:
    """Half-width of the normal-approximation interval of an AUC near `a` (Hanley & McNeil 1982)."""
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    var = (a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a)) / (n_pos * n_neg)
    return _z(level) * math.sqrt(max(var, 0.0))


def samples_for_auc(halfwidth: float = LEAK_HALFWIDTH, a: float = 0.5, level: float = LEVEL) -> int:
    """Smallest n (positives = negatives = n) whose AUC interval near `a` is at most ± halfwidth.
    The AUC's variance is largest near 0.5, so a = 0.5 sizes the worst case."""
    if not 0 < halfwidth < 1:
        raise ValueError("halfwidth must be in (0, 1)")
    n = 2
    while auc_halfwidth(n, n, a, level) > halfwidth:
        n += 1
    return n


def ks_less(x, y) -> tuple[float, float]:
    """(D, p) of the one-sided two-sample KS test, H1: `x` is stochastically smaller than `y`."""
    if len(x) == 0 or len(y) == 0:
        return float("nan"), float("nan")
    r = _st.ks_2samp(x, y, alternative="greater")  # scipy's "greater": x's CDF lies above y's
    return float(r.statistic), float(r.pvalue)


def clopper_pearson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact binomial interval for a rate seen k times in n (its coverage is at least `level`)."""
    if n <= 0:
        return float("nan"), float("nan")
    alpha = 1 - level
    lo = 0.0 if k == 0 else float(_st.beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(_st.beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def poisson_ci(k: int, level: float = LEVEL) -> tuple[float, float]:
    """Exact (Garwood) interval for the mean of a Poisson count seen as k."""
    alpha = 1 - level
    lo = 0.0 if k == 0 else float(_st.chi2.ppf(alpha / 2, 2 * k) / 2)
    hi = float(_st.chi2.ppf(1 - alpha / 2, 2 * k + 2) / 2)
    return lo, hi


def leak_call(lo: float, hi: float, negligible: float = NEGLIGIBLE) -> str:
    """What an AUC interval allows one to say about a timing leak:
    "leak" when it excludes 0.5 (either side: an attacker can flip a slower-hit signal), "no evidence
    of a leak" when it holds 0.5 and lies within 0.5 ± `negligible`, "inconclusive" otherwise."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if lo > 0.5 or hi < 0.5:
        return "leak"
    if lo >= 0.5 - negligible and hi <= 0.5 + negligible:
        return "no evidence of a leak"
    return "inconclusive"


def interval(lo: float, hi: float, digits: int = 2) -> str:
    """"[lo, hi]" for a table cell or a sentence."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "—"
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def rate(k: int, n: int, level: float = LEVEL) -> str:
    """"k/n (95 % CI lo–hi %)": a count with its Clopper-Pearson interval, for sentences."""
    if n <= 0:
        return "0/0"
    lo, hi = clopper_pearson(k, n, level)
    return f"{k}/{n} ({100 * level:.0f} % CI {_pct(lo)}–{_pct(hi)} %)"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}" if x == 0 or x >= 0.1 else f"{100 * x:.1f}"


def separation(hit_ms, miss_ms, seed: int = 0, level: float = LEVEL) -> dict:
    """How well an attacker's TTFTs tell hit probes from miss probes: AUC = P(a miss is slower than
    a hit) with its bootstrap interval, the one-sided KS test (hit < miss), and what that allows."""
    a, lo, hi = auc_ci(miss_ms, hit_ms, level, seed=seed)
    d, p = ks_less(hit_ms, miss_ms)
    return {"n_hit": len(hit_ms), "n_miss": len(miss_ms), "auc": a, "auc_lo": lo, "auc_hi": hi,
            "ks_d": d, "ks_p": p, "call": leak_call(lo, hi)}

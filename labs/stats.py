"""The statistics behind every lab verdict: intervals, tests, sample sizes and the words they allow.

- ``auc`` / ``auc_ci``: ROC AUC of two samples (P(a random positive scores above a random
  negative), ties one half) with a stratified percentile bootstrap interval;
- ``auc_halfwidth`` / ``samples_for_auc``: the Hanley-McNeil normal approximation, to size a run
  before doing it (the bootstrap is what is reported after);
- ``ks_less``: one-sided two-sample Kolmogorov-Smirnov test (scipy), H1: ``x`` tends to be smaller;
- ``clopper_pearson``: exact binomial interval for k of n;
- ``median_ci``: distribution-free interval for a median from two order statistics (a bench's
  median of paired ratios, with what its few pairs can and cannot resolve);
- ``poisson_ci``: exact (Garwood) interval for a count, to put a measured count of collisions
  next to the birthday bound;
- ``leak_call``: "leak", "no evidence of a leak" or "inconclusive" from an AUC interval;
- ``average_precision`` / ``ap_ci``: average precision of ranking positives above negatives
  (the area under the precision-recall curve, as scikit-learn computes it, ties as one
  threshold) with a stratified bootstrap interval: Gu et al.'s audit statistic;
- ``fisher_greater``: one-sided Fisher exact test that a flag is more frequent among positives;
- ``ks_detectable``: the smallest KS distance a two-sample test of n and m can call at α, and
  what that is as a normal shift and an AUC (the power statement of an audit that found nothing).

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


def _ap_sorted(order_pos: np.ndarray, scores: np.ndarray) -> float:
    """AP of labels `order_pos` (1 = positive) already sorted by descending `scores`."""
    distinct = np.flatnonzero(np.diff(scores)) if len(scores) > 1 else np.array([], int)
    last = np.concatenate([distinct, [len(scores) - 1]])  # the last index of every threshold
    tps = np.cumsum(order_pos)[last]
    if tps[-1] == 0:
        return float("nan")
    precision = tps / (last + 1)
    recall = tps / tps[-1]
    return float(np.sum(np.diff(np.concatenate([[0.0], recall])) * precision))


def average_precision(pos, neg) -> float:
    """Average precision of scoring positives above negatives: sum over thresholds of
    (recall step) x precision, ties one threshold (scikit-learn's `average_precision_score`).
    Chance is the share of positives (0.5 for balanced classes); nan if one class is empty."""
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    scores = np.concatenate([pos, neg])
    labels = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))])
    order = np.argsort(-scores, kind="stable")
    return _ap_sorted(labels[order], scores[order])


def ap_ci(pos, neg, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """(AP, low, high): stratified percentile bootstrap, as `auc_ci`. AP reads as Gu et al.
    report it, but it is no test of chance: with no separation its mean is above the share of
    positives in small samples (0.53 for 30 + 30) and this interval misses 0.5 about one run in
    ten at 95 % (scripts/interval_null.py); `auc_ci` (chance exactly 0.5, its interval at its
    level) is the one to compare with 0.5."""
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    a = average_precision(pos, neg)
    if not math.isfinite(a) or len(pos) < 2 or len(neg) < 2:
        return a, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.ones(len(pos)), np.zeros(len(neg))])
    boots = np.empty(n_boot)
    for i in range(n_boot):
        scores = np.concatenate([pos[rng.integers(0, len(pos), len(pos))], neg[rng.integers(0, len(neg), len(neg))]])
        order = np.argsort(-scores, kind="stable")
        boots[i] = _ap_sorted(labels[order], scores[order])
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return a, float(lo), float(hi)


def fisher_greater(k_pos: int, n_pos: int, k_neg: int, n_neg: int) -> float:
    """One-sided Fisher exact p that a flag seen k_pos of n_pos positives and k_neg of n_neg
    negatives is more frequent among positives (nan when a class is empty)."""
    if n_pos <= 0 or n_neg <= 0:
        return float("nan")
    table = [[k_pos, n_pos - k_pos], [k_neg, n_neg - k_neg]]
    return float(_st.fisher_exact(table, alternative="greater").pvalue)


def ks_detectable(n: int, m: int, alpha: float) -> dict:
    """What a one-sided two-sample KS test of n and m samples at `alpha` can call:
    "d": the smallest observed distance between the two empirical CDFs with p < alpha (the
    asymptotic tail exp(-2 d^2 nm/(n+m)) = alpha, conservative for small samples); "shift_sd":
    that distance as a shift of a normal distribution, in standard deviations (2 Phi(s/2) - 1 = d);
    "auc": that shift's ROC AUC; "floor_p": the smallest p samples of these sizes can reach
    (perfect separation, 1/C(n+m, n)). d is 1 (shift_sd and auc None) when only perfectly
    separated samples reach alpha, and all three are None when not even those do."""
    none = {"d": None, "shift_sd": None, "auc": None, "floor_p": float("nan")}
    if n <= 0 or m <= 0 or not 0 < alpha < 1:
        return none
    floor_p = math.exp(-(math.lgamma(n + m + 1) - math.lgamma(n + 1) - math.lgamma(m + 1)))
    d = math.sqrt(-math.log(alpha) * (n + m) / (2 * n * m))
    if floor_p >= alpha:
        return {**none, "floor_p": floor_p}
    if d >= 1:
        return {**none, "d": 1.0, "floor_p": floor_p}
    shift = 2 * float(_st.norm.ppf((1 + d) / 2))
    return {"d": d, "shift_sd": shift, "auc": float(_st.norm.cdf(shift / math.sqrt(2))), "floor_p": floor_p}


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


def median_ci(xs, level: float = LEVEL) -> tuple[float, float, float]:
    """(median, lo, hi): [lo, hi] the order statistics x(k) and x(n+1-k) with the largest k whose
    coverage of the population median, 1 - 2 P(Bin(n, 1/2) < k), is at least `level` (no
    assumption on the distribution); the whole range when n is too small for `level`."""
    x = sorted(xs)
    n = len(x)
    if not n:
        raise ValueError("median_ci of no values")
    med = x[n // 2] if n % 2 else (x[n // 2 - 1] + x[n // 2]) / 2

    def coverage(k: int) -> float:  # of [x(k), x(n + 1 - k)], 1-based
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n
    k = 1
    while k + 1 <= n - k and coverage(k + 1) >= level:
        k += 1
    return med, x[k - 1], x[n - k]


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

"""labs/stats.py: the intervals cover what they claim on synthetic data (fixed seeds), the tests
reject what they should, and the verdict words follow the interval."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as st

from kvplay.labs import stats


def test_auc_counts_ties_half_and_matches_the_pairwise_definition():
    assert stats.auc([2, 3], [1, 1]) == 1.0
    assert stats.auc([1, 1], [2, 3]) == 0.0
    assert stats.auc([1, 2], [1, 2]) == 0.5
    rng = np.random.default_rng(1)
    pos, neg = rng.integers(0, 5, 30), rng.integers(0, 5, 20)  # many ties
    pairwise = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (30 * 20)
    assert stats.auc(pos, neg) == pytest.approx(pairwise)
    assert math.isnan(stats.auc([], [1.0]))


def test_bootstrap_auc_interval_covers_the_true_auc_about_95_percent():
    # positives ~ N(d, 1), negatives ~ N(0, 1): true AUC = Phi(d / sqrt 2)
    rng = np.random.default_rng(7)
    for d in (0.0, 0.8):
        true = float(st.norm.cdf(d / math.sqrt(2)))
        trials, hits = 300, 0
        for t in range(trials):
            _, lo, hi = stats.auc_ci(rng.normal(d, 1, 40), rng.normal(0, 1, 40), n_boot=400, seed=t)
            hits += lo <= true <= hi
        assert 0.89 <= hits / trials <= 0.99, (d, hits / trials)


def test_sample_size_for_plus_minus_0_08_and_the_bootstrap_agrees():
    n = stats.samples_for_auc(0.08)
    assert n == 101  # 1.96 * sqrt(1 / (6 n)) <= 0.08 at AUC 0.5
    assert stats.auc_halfwidth(15, 15) == pytest.approx(0.21, abs=0.01)  # the old 15 + 15 probes
    rng = np.random.default_rng(3)
    widths = [np.subtract(*stats.auc_ci(rng.normal(0, 1, n), rng.normal(0, 1, n), seed=s)[2:0:-1]) / 2
              for s in range(20)]
    assert 0.07 <= float(np.mean(widths)) <= 0.09
    with pytest.raises(ValueError):
        stats.samples_for_auc(0)


def test_clopper_pearson_is_exact_and_at_least_nominal():
    assert stats.clopper_pearson(0, 10)[0] == 0.0 and stats.clopper_pearson(10, 10)[1] == 1.0
    assert stats.clopper_pearson(0, 30)[1] == pytest.approx(1 - 0.025 ** (1 / 30))  # the closed form at k = 0
    for n, p in ((12, 0.1), (30, 0.5), (100, 0.03)):
        cover = sum(st.binom.pmf(k, n, p) for k in range(n + 1)
                    if stats.clopper_pearson(k, n)[0] <= p <= stats.clopper_pearson(k, n)[1])
        assert cover >= 0.95, (n, p, cover)
    assert stats.rate(0, 24) == "0/24 (95 % CI 0–14 %)"


def test_median_interval_uses_order_statistics_and_covers_at_least_nominal():
    assert stats.median_ci(range(1, 10)) == (5, 2, 8)  # n = 9: [x(2), x(8)], 1 - 2 * 10/512 = 96.1 %
    assert stats.median_ci(range(1, 26)) == (13, 8, 18)  # n = 25: [x(8), x(18)], 95.7 %
    assert stats.median_ci([3, 1, 2]) == (2, 1, 3)  # too few for 95 %: the whole range
    assert stats.median_ci([4, 1, 3, 2]) == (2.5, 1, 4)
    with pytest.raises(ValueError):
        stats.median_ci([])
    rng = np.random.default_rng(5)  # skewed, like ratios of run times: the population median is 1
    for n in (9, 25):
        hits = 0
        for _ in range(2000):
            _, lo, hi = stats.median_ci(np.exp(rng.standard_normal(n) * 0.3))
            hits += lo <= 1.0 <= hi
        assert hits / 2000 >= 0.935, (n, hits)  # 95.7-96.1 % exact, less 2000 draws' noise


def test_poisson_interval_is_at_least_nominal_and_holds_the_birthday_counts():
    for mu in (0.5, 1.22, 7.0, 50.0):
        ks = range(0, int(mu * 4 + 30))
        cover = sum(st.poisson.pmf(k, mu) for k in ks if stats.poisson_ci(k)[0] <= mu <= stats.poisson_ci(k)[1])
        assert cover >= 0.95, (mu, cover)
    lo, hi = stats.poisson_ci(2)
    assert lo < 1.22 < hi  # the collide lab's 2 engine collisions vs the bound 1.22
    lo, hi = stats.poisson_ci(3018)
    assert lo < 3052 < hi


def test_ks_less_rejects_a_shift_and_is_uniform_under_the_null():
    rng = np.random.default_rng(11)
    d, p = stats.ks_less(rng.normal(0, 1, 100), rng.normal(1, 1, 100))  # x smaller
    assert p < 1e-6 and d > 0.3
    assert stats.ks_less(rng.normal(1, 1, 100), rng.normal(0, 1, 100))[1] > 0.5  # wrong direction
    ps = [stats.ks_less(rng.normal(0, 1, 50), rng.normal(0, 1, 50))[1] for _ in range(400)]
    assert np.mean(np.array(ps) < 0.05) <= 0.08


def test_leak_call_says_only_what_the_interval_allows():
    assert stats.leak_call(0.62, 0.78) == "leak"
    assert stats.leak_call(0.20, 0.40) == "leak"  # slower hits separate just as well
    assert stats.leak_call(0.43, 0.59) == "no evidence of a leak"
    assert stats.leak_call(0.48, 0.90) == "inconclusive"  # 15 + 15 probes at AUC 0.70
    assert stats.leak_call(float("nan"), float("nan")) == "inconclusive"
    rng = np.random.default_rng(2)  # one null draw; over 300 draws 91 % say this, 5 % "leak", 4 % inconclusive
    s = stats.separation(rng.normal(100, 5, 101).tolist(), rng.normal(100, 5, 101).tolist(), seed=1)
    assert s["call"] == "no evidence of a leak" and s["auc_hi"] - s["auc_lo"] <= 0.2
    s = stats.separation(rng.normal(90, 5, 101).tolist(), rng.normal(100, 5, 101).tolist(), seed=1)
    assert s["call"] == "leak" and s["auc"] > 0.8 and s["ks_p"] < 1e-6


def test_average_precision_as_scikit_learn_defines_it():
    # scikit-learn's documented example: y = [0, 0, 1, 1], scores = [0.1, 0.4, 0.35, 0.8] -> 0.8333
    assert stats.average_precision([0.35, 0.8], [0.1, 0.4]) == pytest.approx(0.8333333)
    assert stats.average_precision([3, 4], [1, 2]) == 1.0
    assert stats.average_precision([1, 1], [1, 1, 1, 1]) == pytest.approx(1 / 3)  # one threshold: the prevalence
    assert math.isnan(stats.average_precision([], [1.0]))
    # the definition, threshold by threshold, on data with ties
    rng = np.random.default_rng(3)
    pos, neg = rng.integers(0, 6, 25).astype(float), rng.integers(0, 6, 35).astype(float)
    ap, last_recall = 0.0, 0.0
    for t in sorted(set(pos) | set(neg), reverse=True):
        tp, fp = (pos >= t).sum(), (neg >= t).sum()
        ap += (tp / len(pos) - last_recall) * tp / (tp + fp)
        last_recall = tp / len(pos)
    assert stats.average_precision(pos, neg) == pytest.approx(ap)


def test_ap_interval_holds_chance_for_identical_classes_and_one_for_separated():
    rng = np.random.default_rng(11)
    covered = sum(lo <= 0.5 <= hi for lo, hi in (stats.ap_ci(rng.normal(size=60), rng.normal(size=60), n_boot=400,
                                                              seed=i)[1:] for i in range(60)))
    assert covered >= 50  # chance AP of balanced classes is about 0.5 (a little above, at small n)
    a, lo, hi = stats.ap_ci([1.0, 2.0, 3.0], [-1.0, -2.0, -3.0])
    assert a == lo == hi == 1.0


def test_fisher_greater_and_ks_detectable():
    assert stats.fisher_greater(16, 16, 0, 16) == pytest.approx(1 / math.comb(32, 16))
    assert stats.fisher_greater(0, 10, 5, 10) == pytest.approx(1.0)
    assert math.isnan(stats.fisher_greater(1, 0, 1, 1))
    d = stats.ks_detectable(250, 250, 1e-8)
    assert d["d"] == pytest.approx(math.sqrt(math.log(1e8) * 500 / (2 * 250 * 250)))  # 0.271
    assert 0.68 < d["auc"] < 0.70 and d["floor_p"] < 1e-100
    few = stats.ks_detectable(10, 10, 1e-8)  # 1/C(20, 10) = 5.4e-6: nothing can reach 1e-8
    assert few["d"] is None and few["floor_p"] == pytest.approx(1 / math.comb(20, 10))
    assert stats.ks_detectable(16, 16, 1e-8)["d"] == 1.0  # only perfect separation reaches it
    # a normal shift of the size it names is called at least half the time (the bound is conservative)
    rng = np.random.default_rng(5)
    d = stats.ks_detectable(50, 50, 1e-8)
    called = sum(stats.ks_less(rng.normal(size=50) - d["shift_sd"], rng.normal(size=50))[1] < 1e-8
                 for _ in range(100))
    assert called >= 50

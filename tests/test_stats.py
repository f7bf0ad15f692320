"""Bootstrap intervals of kvmem_bench.stats: coverage, stratification, paired tests, degenerate input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvmem_bench.stats import Interval, bootstrap_mean, paired_difference, significant


def test_coverage_of_a_bernoulli_mean():
    """Over 300 seeded samples of 30 Bernoulli(0.7) scores the 95% interval holds 0.7 close to 95% of the time
    (percentile bootstrap at n=30 runs a little under nominal, so the bounds are loose but not trivial)."""
    rng = np.random.default_rng(1)
    hits = 0
    for rep in range(300):
        x = (rng.random(30) < 0.7).astype(float)
        mean, lo, hi = bootstrap_mean(x, seed=rep)
        assert lo <= mean <= hi
        hits += lo <= 0.7 <= hi
    assert 0.88 <= hits / 300 <= 0.99


def test_stratified_mean_is_the_mean_of_per_stratum_means():
    values = [1, 1, 1, 0, 0.5, 0.2, 0.3, 0.9, 0.1, 0.4]
    strata = ["a", "a", "a", "a", "b", "b", "c", "c", "c", "c"]
    mean, lo, hi = bootstrap_mean(values, strata)
    expected = np.mean([0.75, 0.35, 0.425])
    assert mean == pytest.approx(expected) and mean != pytest.approx(np.mean(values))
    assert lo < mean < hi


def test_stratified_resampling_stays_within_strata():
    """Two constant strata: resampling within each gives no spread at all; pooled resampling does."""
    x = np.r_[np.zeros(5), np.ones(25)]
    strata = ["short"] * 5 + ["long"] * 25
    assert tuple(bootstrap_mean(x, strata)) == (0.5, 0.5, 0.5)
    pooled = bootstrap_mean(x)
    assert pooled.estimate == pytest.approx(25 / 30) and pooled.width > 0.1


def test_paired_difference_detects_a_real_difference():
    a = np.r_[np.ones(24), np.zeros(6)]
    b = a.copy()
    b[np.flatnonzero(a)[::3]] = 0  # 8 of the 24 successes lost
    assert (a - b).sum() == 8
    diff = paired_difference(a, b)
    assert diff.estimate == pytest.approx(8 / 30)
    assert diff.significant and diff.lo > 0
    assert paired_difference(b, a).significant  # and the other way round
    assert paired_difference(b, a).hi < 0


def test_paired_difference_of_identical_or_exchangeable_scores():
    rng = np.random.default_rng(2)
    a = (rng.random(30) < 0.6).astype(float)
    same = paired_difference(a, a)
    assert tuple(same) == (0.0, 0.0, 0.0) and not same.significant
    # Null with shared per-sample difficulty: a[i], b[i] ~ Bernoulli(p_i) independently. At the 95% level
    # about 5% of seeded samples may come out "significant"; far more would mean a broken test.
    false_positives = 0
    for rep in range(200):
        p = rng.uniform(0.2, 0.9, 30)
        a, b = (rng.random(30) < p).astype(float), (rng.random(30) < p).astype(float)
        false_positives += paired_difference(a, b, seed=rep).significant
    assert false_positives / 200 <= 0.10


def test_paired_is_much_narrower_than_unpaired_when_difficulty_is_shared():
    """Two methods whose scores follow the same per-sample difficulty, b a little worse: the paired interval
    finds the 0.03 gap; two independent intervals (combined as for a difference of independent means)
    are an order of magnitude wider and cannot tell the methods apart."""
    rng = np.random.default_rng(3)
    difficulty = rng.uniform(0.0, 1.0, 40)
    a = difficulty + rng.normal(0, 0.02, 40)
    b = difficulty - 0.03 + rng.normal(0, 0.02, 40)
    paired = paired_difference(a, b)
    ia, ib = bootstrap_mean(a), bootstrap_mean(b)
    unpaired_half = math.hypot(ia.width, ib.width) / 2
    assert paired.significant
    assert paired.width < unpaired_half * 2 / 5
    assert ia.estimate - ib.estimate - unpaired_half < 0  # the unpaired interval includes 0


def test_same_seed_same_interval_and_level_widens_it():
    x = np.linspace(0, 1, 25) ** 2
    assert bootstrap_mean(x, seed=5) == bootstrap_mean(x, seed=5)
    assert bootstrap_mean(x, level=0.99).width > bootstrap_mean(x, level=0.8).width


def test_log_perplexity_gives_a_geometric_mean():
    ppl = np.array([5.0, 20.0, 80.0])
    mean, lo, hi = bootstrap_mean(np.log(ppl))
    assert math.exp(mean) == pytest.approx(20.0)  # the geometric mean, not the arithmetic 35
    assert math.exp(lo) <= 20.0 <= math.exp(hi)


def test_all_equal_values_give_a_zero_width_interval():
    for v in (0.1, 1.0, 3.7):
        r = bootstrap_mean([v] * 17)
        assert isinstance(r, Interval) and r.lo == r.hi == r.estimate
        assert r.estimate == pytest.approx(v)
    assert not significant(0.0, 0.0) and significant(0.1, 0.2) and significant(-0.3, -0.1)
    assert not significant(-0.1, 0.2)


@pytest.mark.parametrize("call,message", [
    (lambda: bootstrap_mean([]), "empty"),
    (lambda: bootstrap_mean([1.0, float("nan")]), "NaN"),
    (lambda: bootstrap_mean([1.0, 2.0], strata=["a"]), "one label per value"),
    (lambda: bootstrap_mean([1.0, 2.0], level=1.5), "level"),
    (lambda: bootstrap_mean([1.0, 2.0], n_boot=0), "n_boot"),
    (lambda: paired_difference([1.0, 0.0], [1.0]), "got 2 values in a and 1 in b"),
    (lambda: paired_difference([], []), "empty"),
])
def test_bad_input_is_a_clear_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()

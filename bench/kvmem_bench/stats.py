"""Bootstrap confidence intervals for benchmark reports (numpy only, vectorised).

* `bootstrap_mean(values, strata)`: percentile-bootstrap CI of a mean. With `strata` (one label per
  value, e.g. the task), the statistic is the mean of per-stratum means (every task weighs the same,
  however many samples it has) and each bootstrap replicate resamples within each stratum.
* `paired_difference(a, b, strata)`: CI of the mean of `a[i] - b[i]`, where `a[i]` and `b[i]` are two
  methods' scores on the same sample `i`. Pairing removes the per-sample difficulty both methods share,
  so it detects differences that two separate intervals cannot.

Scores may be 0/1, fractional or any real number. Perplexity: pass log-perplexity (mean NLL) to get a
CI of the geometric mean (exponentiate the three numbers), or of the log-ratio of two methods'
geometric means with `paired_difference`; passing raw perplexities gives the arithmetic mean.

Each call draws all its bootstrap indices as one integer array (n_boot x n), so a report can afford
thousands of calls. The same `seed` gives the same indices for the same strata sizes (common random
numbers across the methods of one table).
"""

from __future__ import annotations

import math
from typing import Hashable, NamedTuple, Sequence

import numpy as np


class Interval(NamedTuple):
    """A point estimate and its bootstrap confidence interval; unpacks as (estimate, lo, hi)."""

    estimate: float
    lo: float
    hi: float

    @property
    def significant(self) -> bool:
        """The interval excludes 0 (for a difference: the two methods differ at this level)."""
        return significant(self.lo, self.hi)

    @property
    def width(self) -> float:
        return self.hi - self.lo


def significant(lo: float, hi: float) -> bool:
    """True when the interval [lo, hi] excludes 0."""
    return lo > 0.0 or hi < 0.0


def _as_values(values: Sequence[float] | np.ndarray, name: str = "values") -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError(f"{name} is empty: a mean needs at least one value")
    if not np.isfinite(v).all():
        raise ValueError(f"{name} contains NaN or infinity (pass log-perplexity rather than an overflowed perplexity)")
    return v


def _strata_codes(strata: Sequence[Hashable] | np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(stratum code per value, values per stratum)."""
    labels = np.asarray(strata)
    if labels.ndim != 1 or labels.shape[0] != n:
        raise ValueError(f"strata must hold one label per value: got {labels.shape[0] if labels.ndim else 0} labels "
                         f"for {n} values")
    _, codes, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    return codes, sizes


def _check_options(n_boot: int, level: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be at least 1; got {n_boot}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), e.g. 0.95; got {level}")


def bootstrap_means(values: Sequence[float] | np.ndarray, strata: Sequence[Hashable] | None = None,
                    n_boot: int = 2000, seed: int = 0) -> tuple[float, np.ndarray]:
    """(the statistic, its `n_boot` bootstrap replicates): the mean, or the mean of per-stratum means."""
    v = _as_values(values)
    rng = np.random.default_rng(seed)
    if strata is None:
        idx = rng.integers(0, v.size, size=(n_boot, v.size))
        return float(v.mean()), v[idx].mean(axis=1)
    codes, sizes = _strata_codes(strata, v.size)
    order = np.argsort(codes, kind="stable")  # each stratum's values contiguous, in stratum order
    v, codes = v[order], codes[order]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    # Position j of a replicate redraws from j's own stratum: start of the stratum + uniform offset in it
    # (a 62-bit draw modulo the stratum size: bias < 2**-40, and faster than integers() with array bounds).
    idx = starts[codes] + rng.integers(0, 1 << 62, size=(n_boot, v.size)) % sizes[codes]
    per_stratum = np.add.reduceat(v[idx], starts, axis=1) / sizes  # (n_boot, strata)
    return float((np.add.reduceat(v, starts) / sizes).mean()), per_stratum.mean(axis=1)


def bootstrap_mean(values: Sequence[float] | np.ndarray, strata: Sequence[Hashable] | None = None,
                   n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> Interval:
    """Mean (or mean of per-stratum means) with its percentile-bootstrap `level` CI: (mean, lo, hi).

    With `strata`, resampling is done within each stratum (stratified bootstrap). All-equal values give
    a zero-width interval. Raises ValueError on empty input, non-finite values or mismatched strata.
    """
    _check_options(n_boot, level)
    estimate, reps = bootstrap_means(values, strata, n_boot, seed)
    if reps.min() == reps.max():  # no spread (e.g. all values equal): exactly zero width, no rounding noise
        return Interval(estimate, estimate, estimate)
    lo, hi = np.quantile(reps, [(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    return Interval(estimate, float(lo), float(hi))


def paired_difference(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                      strata: Sequence[Hashable] | None = None, n_boot: int = 2000, seed: int = 0,
                      level: float = 0.95) -> Interval:
    """Mean paired difference mean(a - b) (per-stratum means averaged, with `strata`) and its bootstrap CI.

    `a[i]` and `b[i]` must be two methods' scores on the same sample `i`; `.significant` says whether
    the interval excludes 0. Identical inputs give (0, 0, 0).
    """
    va, vb = _as_values(a, "a"), _as_values(b, "b")
    if va.size != vb.size:
        raise ValueError(f"paired scores need one b per a: got {va.size} values in a and {vb.size} in b")
    return bootstrap_mean(va - vb, strata, n_boot, seed, level)


# -- medians (latencies: skewed, with outliers) ---------------------------------------------------------
def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else math.nan


def _boot_medians(xs: list[float], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    v = np.asarray(xs, dtype=float)
    return np.median(v[rng.integers(0, v.size, size=(n_boot, v.size))], axis=1)


def bootstrap_median(xs: list[float], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(median, lo, hi): the percentile-bootstrap CI of the median; NaNs for no values."""
    if not len(xs):
        return math.nan, math.nan, math.nan
    reps = _boot_medians(xs, n_boot, np.random.default_rng(seed))
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(xs)), float(lo), float(hi)


def median_ratio(num: list[float], den: list[float], n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """median(num) / median(den) with a bootstrap CI, the two samples resampled independently."""
    if not len(num) or not len(den):
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    reps = _boot_medians(num, n_boot, rng) / _boot_medians(den, n_boot, rng)
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return float(np.median(num) / np.median(den)), float(lo), float(hi)

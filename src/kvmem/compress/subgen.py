"""`subgen`: SubGen's sampled attention estimator, stored as weighted rows.

Zandieh, Han, Mirrokni, Karbasi 2024, "SubGen: Token Generation in Sublinear Time and Memory" (arXiv 2402.06082).
A query's attention output z = N / D, N = sum_i exp(q.k_i s) v_i, D = sum_i exp(q.k_i s), is estimated as N^/D^:

* D^ from a clustering of the keys: in stream (position) order a key within distance delta of an earlier cluster's
  centre joins the nearest such cluster, otherwise it opens one; each cluster keeps its count n_c and t_c = min(t, n_c)
  uniform (reservoir) samples: D^ = sum_c (n_c / t_c) sum_{k sampled in c} exp(q.k s).
* N^ from l2 sampling of the values: s i.i.d. draws j with p_j = |v_j|^2 / sum_i |v_i|^2 (what s online l2 reservoirs
  hold): N^ = (1/s) sum_j exp(q.k_j s) v_j / p_j.

As kvmem rows. A row (k, u, log-weight b) adds e^b exp(q.k s) to the denominator and e^b exp(q.k s) u to the numerator.
A value-0 row counts in the denominator only; no row counts in the numerator only, so a small mixing constant
alpha (`mix`) is used: value sample j (drawn c_j times) is the row (k_j, v_j / alpha, log(alpha c_j / (s p_j))), cluster
sample k the row (k_k, 0, log((1 - alpha) n_c / t_c)). The kept rows then give numerator N^ and denominator
alpha D^_v + (1 - alpha) D^, D^_v = (1/s) sum_j exp(q.k_j s) / p_j (itself an unbiased estimate of D), so attention over
them is N^ / D^ up to a relative O(alpha) term, exactly SubGen's as alpha -> 0. A token drawn both ways is one row:
weight W = alpha c_j/(s p_j) + (1 - alpha) n_c/t_c, value (c_j/(s p_j)) v_j / W. Rows kept exact (protected, `sinks`,
`recent`) keep weight 1 and their values: the estimated part is on the same scale as exact rows (both estimate sums of
exp(q.k s) terms), so they add up as the full head's do. A row's existing log-weight (an earlier compaction) multiplies
its terms, so it is added to the new one. alpha = 1e-3: float32 values scaled by 1/alpha lose nothing (and bf16 keeps
its relative precision); the O(alpha) term is then well below the sampling error. fp16 values that overflow are
refused (raise `mix`).

Our choices, the paper's code and full text being unreachable here (only its abstract and summaries):
* the head's budget n_keep (kvmem's allocator) less the exact rows is B rows: s = round(value_fraction x B) value draws
  (at least 1, at most B - 1), the cluster samples get what the distinct draws leave (B - distinct), so duplicates
  do not waste the budget. One row: a value draw alone (alpha = 1 there: no cluster estimates D).
* delta: the smallest (16 bisection steps over [0, the largest key distance]) whose clusters' samples, less those
  already drawn as values, fit the cluster budget; if even one cluster's t samples do not fit, it keeps fewer.
  Distances are Euclidean on the keys as stored (after RoPE: kvmem never rotates them again); the head's pairwise
  distance matrix is held while it is clustered (T^2 floats).
* the clustering and sampling are what the streaming algorithm would end with, computed on the whole prompt at once;
  randomness comes from a torch.Generator seeded by `seed`, layer and head, so results are reproducible.
* `sinks` (first rows) and `recent` (newest rows) kept exact within the budget: the abstract does not say; default 0,
  SubGen as described. l2 sampling's worst case is a row of large attention and small value norm (an attention sink:
  its 1/p_j is large); on SmolLM2 (a 1024-token README prefix, keep 0.25, the last 64 tokens' queries) sinks=4 halved
  the mean relative error of the heads' attention output (2.1 -> 1.1; random 0.75, knorm 0.28), hence the option.
* query-agnostic: no observed query is read, so it compresses without the question.
* score (used by allocators other than uniform): a row's l2 sampling probability. Full-precision rows only (evict.py
  refuses quantized and mixed-precision caches, budget=razor and decode-phase use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError

BISECTION_STEPS = 16


@dataclass
class Sketch:
    """One head's SubGen samples, as indices into its compressible rows. value_weight: c_j / (s p_j) of each distinct
    value draw; cluster_weight: n_c / t_c of each cluster sample's cluster; mix: alpha (1 when there is no cluster)."""

    exact: Tensor
    value_rows: Tensor
    value_weight: Tensor
    cluster_rows: Tensor
    cluster_weight: Tensor
    mix: float
    delta: float = math.nan  # the clustering's distance threshold (nan: no clusters)

    @property
    def rows(self) -> Tensor:
        return torch.cat([self.exact, self.value_rows, self.cluster_rows]).unique()


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SubGen(Method):
    name = "subgen"

    def __init__(self, mix: float = 1e-3, value_fraction: float = 0.5, t: int = 2, seed: int = 0, sinks: int = 0,
                 recent: int = 0):
        bad = []
        if not _number(mix) or not 0 < mix < 1:
            bad.append(f"mix={mix!r} (a number in (0, 1): the value samples' share of the denominator)")
        if not _number(value_fraction) or not 0 < value_fraction < 1:
            bad.append(f"value_fraction={value_fraction!r} (a number in (0, 1): the budget's share of value samples)")
        if not _count(t) or t < 1:
            bad.append(f"t={t!r} (an integer >= 1: samples per cluster)")
        if not _count(seed):
            bad.append(f"seed={seed!r} (an integer)")
        for key, value in (("sinks", sinks), ("recent", recent)):
            if not _count(value) or value < 0:
                bad.append(f"{key}={value!r} (an integer >= 0: rows kept exact)")
        if bad:
            raise KVMemError(f"subgen: bad option {'; '.join(bad)}")
        self.mix, self.value_fraction, self.t, self.seed = float(mix), float(value_fraction), t, seed
        self.sinks, self.recent = sinks, recent
        self._pending: dict[tuple, Sketch] = {}  # select's sketch, for the refit of the same head

    def score(self, head: HeadView) -> Tensor:
        return _l2(head.values)

    def sketch(self, head: HeadView, n_keep: int) -> Sketch:
        """The head's samples for a budget of `n_keep` rows (every row exact when it allows them all)."""
        n = head.keys.shape[0]
        empty = torch.zeros(0, dtype=torch.long)
        if n_keep >= n:
            return Sketch(torch.arange(n), empty, empty.double(), empty, empty.double(), self.mix)
        g = torch.Generator().manual_seed(self.seed * 100_003 + head.layer * 101 + head.head)
        n_sinks = min(self.sinks, n_keep)
        n_recent = min(self.recent, n_keep - n_sinks)
        exact = torch.cat([torch.arange(n_sinks), torch.arange(n - n_recent, n)])
        budget = n_keep - exact.numel()
        rest = torch.arange(n_sinks, n - n_recent)
        if budget == 0:
            return Sketch(exact, empty, empty.double(), empty, empty.double(), self.mix)
        # N^: s i.i.d. l2 draws; a token drawn c times is one row standing for its c draws
        s = 1 if budget == 1 else min(max(1, round(self.value_fraction * budget)), budget - 1)
        p = _l2(head.values[rest]).double()
        draws, counts = torch.multinomial(p, s, replacement=True, generator=g).unique(return_counts=True)
        value_weight = counts.double() / (s * p[draws])
        room = budget - draws.numel()
        if room == 0:  # no cluster: the value draws estimate the denominator too
            return Sketch(exact, rest[draws], value_weight, empty, empty.double(), 1.0)
        taken = torch.zeros(rest.numel(), dtype=torch.bool)
        taken[draws] = True
        rows, weight, delta = _cluster_samples(head.keys[rest].float(), room, taken, torch.rand(rest.numel(), generator=g),
                                               self.t)
        return Sketch(exact, rest[draws], value_weight, rest[rows], weight, self.mix, delta)

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        sketch = self.sketch(head, n_keep)
        self._pending[(head.layer, head.head, head.keys.shape[0], head.keys.data_ptr())] = sketch
        return sketch.rows

    def refit(self, head: HeadView, chosen: Tensor, n: int) -> tuple[Tensor, Tensor]:
        sketch = self._pending.pop((head.layer, head.head, n, head.keys.data_ptr()), None)
        if sketch is None or not torch.equal(sketch.rows, chosen):
            raise KVMemError(f"subgen: layer {head.layer} head {head.head} was refit without its own selection")
        weight = torch.zeros(chosen.numel(), dtype=torch.float64)  # W: the row's new weight
        scale = torch.zeros(chosen.numel(), dtype=torch.float64)  # how many times v_j the row's numerator term holds
        at = lambda rows: torch.searchsorted(chosen, rows)  # noqa: E731
        weight[at(sketch.exact)], scale[at(sketch.exact)] = 1.0, 1.0
        weight.index_add_(0, at(sketch.value_rows), sketch.mix * sketch.value_weight)
        scale.index_add_(0, at(sketch.value_rows), sketch.value_weight)
        weight.index_add_(0, at(sketch.cluster_rows), (1 - sketch.mix) * sketch.cluster_weight)
        values = (head.values[chosen].double() * (scale / weight)[:, None]).to(head.values.dtype)
        if not torch.isfinite(values).all():
            raise KVMemError(f"subgen: layer {head.layer} head {head.head}'s values scaled by 1/mix overflow "
                             f"{head.values.dtype} (raise mix, now {self.mix})")
        old = head.log_weights[chosen].float() if head.log_weights is not None else torch.zeros(chosen.numel())
        return values, old + weight.log().float()


def _l2(values: Tensor) -> Tensor:
    """l2 sampling probabilities |v_i|^2 / sum |v|^2 (uniform if every value is 0)."""
    sq = values.float().pow(2).sum(dim=-1)
    return sq / sq.sum() if float(sq.sum()) > 0 else torch.full_like(sq, 1.0 / max(sq.numel(), 1))


def _cluster_samples(keys: Tensor, room: int, taken: Tensor, priority: Tensor, t: int) -> tuple[Tensor, Tensor, float]:
    """Cluster samples (indices into `keys`), their weights n_c / t_c and delta, for the smallest delta whose samples not
    already `taken` number at most `room`. A cluster's samples: its t members of lowest `priority` (uniform: a
    reservoir's sample)."""
    dist = torch.cdist(keys[None], keys[None])[0].numpy()
    np.fill_diagonal(dist, 0.0)  # the matmul form of cdist leaves rounding there
    limit = room + int(taken.sum())  # each cluster holds a sample, at most `taken` of them are taken: more do not fit

    def at(delta: float, per: int) -> tuple[Tensor, Tensor] | None:
        covered, centres = np.zeros(len(keys), dtype=bool), []
        i = 0
        while True:  # stream order: a key opens a cluster iff no earlier centre is within delta
            centres.append(i)
            if len(centres) > limit:
                return None
            covered |= dist[i] <= delta
            later = covered[i + 1:]
            j = int(later.argmin()) if later.size else 0  # the next key no centre covers, if any
            if not later.size or later[j]:
                break
            i += 1 + j
        # each key joins the nearest centre that existed when it arrived (its own, for a centre)
        to_centre = dist[centres]
        to_centre[np.array(centres)[:, None] > np.arange(len(keys))[None, :]] = np.inf
        cluster = torch.from_numpy(to_centre.argmin(axis=0))
        order = torch.argsort(cluster.double() * 2 + priority.double())  # by cluster, then priority
        sizes = torch.bincount(cluster, minlength=len(centres))
        starts = torch.cumsum(sizes, 0) - sizes
        rank = torch.arange(len(keys)) - starts[cluster[order]]
        rows = order[rank < per]
        if int((~taken[rows]).sum()) > room:
            return None
        n_c = sizes[cluster[rows]].double()
        return rows, n_c / n_c.clamp(max=per)

    top = hi = float(dist.max())
    fit = at(top, t)
    if fit is None:  # one cluster's t samples do not fit: it keeps fewer (one always fits: room >= 1)
        per = t - 1
        while (fit := at(top, per)) is None:
            per -= 1
    elif (exact := at(0.0, t)) is not None:  # every distinct key a cluster: the budget holds them all
        fit, hi = exact, 0.0
    else:
        lo, hi = 0.0, top  # at(lo) does not fit, at(hi) does (`fit`)
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            found = at(mid, t)
            lo, hi, fit = (lo, mid, found) if found is not None else (mid, hi, fit)
    rows, weight = fit
    order = rows.argsort()
    return rows[order], weight[order], hi

"""`rcstat`: relative contextualization of raw (pre-softmax) attention logits.

Mahapatra, Agarwal, Saxena and Mitra 2025, "RCStat: A Statistical Framework for using Relative
Contextualization in Transformers" (Adobe Research, arXiv 2506.19549). The paper reads the raw logits
f(i, j) = <q_j, k_i> (no scaling, no softmax) of a head as samples of random variables: cross-contextualization
X(p1, g'), the logits of prompt keys i in p1 from queries j in g' (Def. 3.2), and self-contextualization
Y(g1, g'), the logits of generated keys from generated queries, i <= j (Def. 3.4). Relative contextualization
(RC) compares the two: p1 matters to g' where its logits rise above the ones g' gives itself. KV compression
evicts what RC says is not contextualized, by thresholds, so each head keeps what its RC earns.

Here, as in SnapKV, the last `window` prompt tokens stand for the generation (there is none at compression):
g' = g1 = the window, and each older token i is its own p1 = {i}. Its score is an upper bound of the expected
RC, E[(X_i - Y)^+] = integral of P(Y <= t < X_i) dt <= integral of min(F_Y(t), 1 - F_X_i(t)) dt, which needs only
the two marginals (the joint of X_i and Y is unknown): the Frechet-Hoeffding bound, reached when X_i and Y are
paired largest to smallest. It is computed per query head (X_i: its `window` logits; Y: the window's
causal self logits) and averaged over the query heads sharing the KV head. A key no window query can see (out of
a sliding window) scores -inf; the window is always kept.

Not verified against the paper: its full text and code could not be reached from here (only its abstracts and
its Definitions 3.1-3.4 of CC and SC, through a review), so the RC bound above is kvmem's derivation from those
definitions, not the paper's equation; its exact bound and threshold rule may differ. The paper's thresholds
set each head's budget; kvmem instead cuts the scores at the keep ratio, by default with `budget=adaptive`: one
threshold over the heads of a layer (Ada-KV's pooling, which keeps a 20 % floor per head); `budget=global`
puts one threshold over every head of every layer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError


class RCStat(Method):
    name = "rcstat"
    budget = "adaptive"  # the paper's RC thresholds give each head its own budget
    observe_window = 32

    def __init__(self, window: int = 32):
        if window < 2:
            raise KVMemError(f"rcstat needs window >= 2 (the window's self-contextualization); got window={window}")
        self.window = window
        self.observe_window = window

    def score(self, head: HeadView) -> Tensor:
        q = head.queries[:, -self.window:].float()
        qp = head.query_positions[-self.window:]
        logits = q @ head.keys.float().T  # (group, W, T): raw <q_j, k_i>, as the paper defines them
        seen = head.positions[None, :] <= qp[:, None]
        if head.sliding_window is not None:
            seen &= (qp[:, None] - head.positions[None, :]) < head.sliding_window
        in_window = head.positions >= qp.min()
        score = torch.full((head.positions.numel(),), float("inf"))
        if (~in_window).any():  # a context no longer than the window has nothing to evict
            bounds = [rc_bound(lg[:, ~in_window], seen[:, ~in_window], lg[:, in_window][seen[:, in_window]])
                      for lg in logits]
            score[~in_window] = torch.stack(bounds).mean(dim=0)
        return score


def rc_bound(cross: Tensor, seen: Tensor, self_logits: Tensor) -> Tensor:
    """Per key i: the upper bound of E[(X_i - Y)^+], integral of min(F_Y(t), P(X_i > t)) dt. `cross` (W, P): key i's
    logits from the window's queries (X_i; only the `seen` ones count); `self_logits`: the window's own (Y). The bound
    is reached by pairing X_i's quantiles with Y's reversed ones, so it is computed as integral over u of
    (Q_X(u) - Q_Y(1 - u))^+: X_i's k-th smallest of m logits against the band of Y's quantiles it is paired with."""
    y = self_logits.sort().values
    n, width = y.numel(), cross.shape[0]
    x = cross.T.masked_fill(~seen.T, float("-inf")).sort(dim=-1).values  # unseen logits first
    n_seen = seen.sum(dim=0)
    out = torch.full((x.shape[0],), float("-inf"))  # a key no window query sees
    for m in n_seen.unique().tolist():  # one count unless a sliding window hides some keys from some queries
        if m == 0:
            continue
        keys = n_seen == m
        # in units of 1/(n m): X's k-th smallest holds u in [k n, (k+1) n), paired with v = 1 - u in
        # [lo, lo + n), lo = (m - 1 - k) n; Y's r-th smallest holds v in [r m, (r + 1) m)
        lo = (m - 1 - torch.arange(m)) * n
        ranks = (lo // m)[:, None] + torch.arange(n // m + 2)  # every rank overlapping the band
        overlap = (torch.minimum(lo[:, None] + n, (ranks + 1) * m) - torch.maximum(lo[:, None], ranks * m)).clamp(min=0)
        weight = torch.where(ranks < n, overlap, 0) / (n * m)
        pairs = x[keys][:, width - m:, None] - y[ranks.clamp(max=n - 1)]  # (keys, m, band)
        out[keys] = (pairs.clamp(min=0) * weight).sum(dim=(1, 2))
    return out

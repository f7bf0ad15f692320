"""`attention-matching`: latent KV compaction by Attention Matching.

Zweiger et al. 2026, "Fast KV Compaction via Attention Matching" (arXiv 2602.16284; reference code
github.com/adamzweiger/compaction, `compaction/algorithms/highest_attention_keys.py`, its "AM-HighestAttnKeys"):
per KV head, build t compact rows (keys C1, log-weights beta, values C2) whose attention reproduces the full
head's for a set of reference queries. The problem splits into three subproblems, solved in turn:

 1. keys: the t keys that receive the most attention from the reference queries, kept as they are (original
    rows and positions). Score per key: its max attention over the queries (`score=max`, the reference code's
    default) or its mean (`score=mean`).
 2. attention mass: weights w_j >= 0 with sum_j w_j exp(q.k_j s) ~ sum_i exp(q.k_i s) over every key the head
    held, for every reference query: non-negative least squares (scipy's active-set `nnls`, exact, where the
    reference code clamps a plain least-squares solution). Stored as the row's log-weight beta_j = log w_j,
    which kvmem's attention adds to the row's logit (`KVLayer.log_weights`).
 3. values: the least squares min ||P C2 - Y||^2 + lam ||C2||^2, P the attention of the reference queries over the
    compacted head (kept keys with their log-weights), Y the full head's attention output: closed form.
    lam = ridge * ||P||_2^2, the reference code's spectral scaling of its ridge option.

Where this departs from the paper: the reference queries are the head's query group's last `window` queries
(kvmem's observation window, as SnapKV uses them), not the paper's self-study / repeat-prefill queries generated
by running the model on the context; causal and sliding-window masks are applied to them (a window query sees only
keys at or before it). Rows the budget protects (`protect_from`) are kept unchanged and enter both sides of the
fit. Existing row log-weights (an earlier compaction) count in the full head's attention. kvmem's budgets choose t
per head; the paper's precomputed non-uniform head budgets are not used. Quantized and mixed-precision rows are
refused (evict.py): their values cannot be rewritten in place.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import nnls
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError

SCORES = ("max", "mean")
MIN_WEIGHT = 1e-12  # floor on w_j before the log: NNLS may zero a weight; the reference code clamps at the same value


class AttentionMatching(Method):
    name = "attention-matching"
    observe_window = 64

    def __init__(self, window: int = 64, score: str = "max", ridge: float = 1e-4):
        bad = []
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            bad.append(f"window={window!r} (an integer >= 1: how many recent queries are the reference queries)")
        if score not in SCORES:
            bad.append(f"score={score!r} (one of {', '.join(SCORES)}: how a key's attention is pooled over queries)")
        if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not math.isfinite(ridge) or ridge < 0:
            bad.append(f"ridge={ridge!r} (a finite number >= 0: the value fit's regularization)")
        if bad:
            raise KVMemError(f"attention-matching: bad option {'; '.join(bad)}")
        self.window, self.score_method, self.ridge = window, score, float(ridge)
        self.observe_window = window  # the cache must keep this many recent queries

    # -- the reference queries' view of the full head ------------------------------------------------
    def _logits(self, head: HeadView) -> Tensor:
        """(N, T) logits of the reference queries (the query group's last `window`, flattened) over the head's
        rows, row log-weights added, -inf where the causal or sliding mask hides a row; queries that see no row
        are left out."""
        q = head.queries[:, -self.window:].float()
        qp = head.query_positions[-self.window:]
        logits = torch.einsum("gqd,kd->gqk", q * head.scaling, head.keys.float())
        if head.log_weights is not None:
            logits = logits + head.log_weights.float()
        allowed = head.positions[None, :] <= qp[:, None]
        if head.sliding_window is not None:
            allowed &= (qp[:, None] - head.positions[None, :]) < head.sliding_window
        logits = logits.masked_fill(~allowed[None], float("-inf")).reshape(-1, head.keys.shape[0])
        return logits[torch.isfinite(logits).any(dim=1)]

    def score(self, head: HeadView) -> Tensor:
        """(T,) attention each key receives from the reference queries, pooled by `score` (max or mean)."""
        attention = self._logits(head).softmax(dim=-1)
        if attention.shape[0] == 0:  # no reference query sees a row: nothing to rank by
            raise KVMemError(f"attention-matching: layer {head.layer} head {head.head} has no reference query that "
                             "sees its rows (prefill before compressing)")
        return attention.amax(dim=0) if self.score_method == "max" else attention.mean(dim=0)

    # -- steps 2 and 3 ------------------------------------------------------------------------------
    def refit(self, head: HeadView, chosen: Tensor, n: int) -> tuple[Tensor, Tensor]:
        logits = self._logits(head).double()  # float64: a kept row far below the query's max must not underflow
        # exp(logit - the query's max): the same shift on both sides of the mass fit, so it changes nothing but range
        exp = (logits - logits.amax(dim=1, keepdim=True)).exp()  # (N, T); 0 where masked
        old = head.log_weights[chosen].float() if head.log_weights is not None else torch.zeros(chosen.numel())
        region, kept = exp[:, :n], exp[:, chosen]
        # only queries that see some row of the compacted head constrain it (an early window query may see none of
        # the kept rows, only dropped ones: no weights or values could give it its output back)
        sees = (kept.sum(dim=1) + exp[:, n:].sum(dim=1)) > 0
        if not bool(sees.any()):
            # no reference query sees a kept row: only in a sliding layer whose window has passed them, where no later
            # query will see them either; they stay as they were
            return head.values[chosen], old
        exp, region, kept = exp[sees], region[sees], kept[sees]
        mass, _ = nnls(kept.numpy(), region.sum(dim=1).numpy(), maxiter=50 * max(kept.shape[1], 1))
        w = torch.from_numpy(np.maximum(mass, MIN_WEIGHT))
        log_weights = old + w.log().float()  # the fitted weight multiplies exp(logit), which holds the old log-weight

        values = head.values.double()
        target = (exp @ values) / exp.sum(dim=1, keepdim=True)  # Y: the full head's attention output
        compact = torch.cat([kept * w, exp[:, n:]], dim=1)  # the compacted head: kept rows weighted, protected as is
        p = compact / compact.sum(dim=1, keepdim=True)
        p_kept, p_protected = p[:, :chosen.numel()], p[:, chosen.numel():]
        residual = target - p_protected @ values[n:]  # what the kept rows' values must produce
        lam = self.ridge * float(torch.linalg.matrix_norm(p_kept, ord=2)) ** 2
        # ridge as an augmented least squares: solvable with fewer queries than rows, or lam = 0
        a = torch.cat([p_kept, math.sqrt(lam) * torch.eye(chosen.numel(), dtype=torch.float64)])
        b = torch.cat([residual, residual.new_zeros((chosen.numel(), values.shape[1]))])
        new_values = torch.linalg.lstsq(a, b, driver="gelsd").solution
        if not torch.isfinite(new_values).all():
            raise KVMemError(f"attention-matching: the value fit of layer {head.layer} head {head.head} is not finite "
                             f"(raise ridge, now {self.ridge})")
        return new_values.to(head.values.dtype), log_weights

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

Reference queries (`queries=`). The paper fits on many queries that attend over the context: self-study and
repeat-prefill queries, up to 10,000 a KV head in the reference code (`max_query_vectors_per_kv_head`), whose
simplest generator (`query_generation/context_prefill.py`) takes the context's own queries from one prefill. kvmem's
default, `queries=prompt`, is that one: the prompt the cache holds is replayed from position 0 (one more prefill,
memoized for every keep ratio tried on copies of one cache) and every query of the head's group is a reference
query, a random subset of `max_queries` (2048) of them when there are more (the reference code subsamples with
`randperm` too; the seed is fixed), plus the observed queries after the prompt (the question, query-aware). It needs
the model, so it is compressed after prefill (`compress(..., context=ModelContext(lm, ids))`), not layer by layer.
`queries=window` fits on the group's last `window` observed queries only (no model, so `Compressor` and
`model.generate` can run it), and degrades where the compacted head keeps more rows than it has reference
queries: NNLS then leaves at most as many rows with a weight above zero (measured on SmolLM2 2k fact-single at keep 0.5: 21 %
of the kept rows; the others are silenced), and the least squares for the values has fewer equations than unknowns.
That is why `window` is not the default (with it, fact-single at 2k scored 0.03 at keep 0.5, below random).

Where this departs from the paper otherwise: causal and sliding-window masks are applied to the reference queries
(a query sees only keys at or before it). Rows the budget protects (`protect_from`) are kept unchanged and enter
both sides of the fit. Existing row log-weights (an earlier compaction) count in the full head's attention. kvmem's
budgets choose t per head; the paper's precomputed non-uniform head budgets are not used. Quantized and
mixed-precision rows are refused (evict.py): their values cannot be rewritten in place.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import nnls
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, memoized_replay, replay
from kvmem.errors import KVMemError

SCORES = ("max", "mean")
QUERIES = ("prompt", "window")
MIN_WEIGHT = 1e-12  # floor on w_j before the log: NNLS may zero a weight; the reference code clamps at the same value


class AttentionMatching(Method):
    name = "attention-matching"
    observe_window = 64
    needs_model = True  # queries="prompt" (the default) replays the prompt; "window" does not

    def __init__(self, window: int = 64, score: str = "max", ridge: float = 1e-4, queries: str = "prompt",
                 max_queries: int = 2048):
        bad = []
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            bad.append(f"window={window!r} (an integer >= 1: how many recent queries are the reference queries)")
        if score not in SCORES:
            bad.append(f"score={score!r} (one of {', '.join(SCORES)}: how a key's attention is pooled over queries)")
        if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not math.isfinite(ridge) or ridge < 0:
            bad.append(f"ridge={ridge!r} (a finite number >= 0: the value fit's regularization)")
        if queries not in QUERIES:
            bad.append(f"queries={queries!r} (one of {', '.join(QUERIES)}: the prompt's replayed queries or the "
                       "observed window's)")
        if not isinstance(max_queries, int) or isinstance(max_queries, bool) or max_queries < 1:
            bad.append(f"max_queries={max_queries!r} (an integer >= 1: reference queries per KV head)")
        if bad:
            raise KVMemError(f"attention-matching: bad option {'; '.join(bad)}")
        self.window, self.score_method, self.ridge = window, score, float(ridge)
        self.observe_window = window  # the cache must keep this many recent queries
        self.queries, self.max_queries = queries, max_queries
        self.needs_model = queries == "prompt"
        self._reference: dict[int, list[tuple[Tensor, Tensor]]] = {}  # per layer, per KV head: (N, D) queries, (N,)
        self._prompt_len = 0

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext | None):
        if self.queries == "prompt":
            self._reference = memoized_replay(context, cache, self.name, (self.max_queries,), self.prompt_queries)
            self._prompt_len = len(context.ids)
        return super().score_cache(views, cache, context)

    @torch.no_grad()
    def prompt_queries(self, lm, ids: list[int]) -> dict[int, list[tuple[Tensor, Tensor]]]:
        """Per layer and KV head: the prompt's queries of the head's group (after RoPE, flattened over the group)
        and their positions, a seeded random subset of `max_queries` when there are more."""
        generator = torch.Generator().manual_seed(0)
        out: dict[int, list[tuple[Tensor, Tensor]]] = {}

        def record(idx: int, queries: Tensor, keys: list[Tensor], positions: list[Tensor], new_pos: Tensor, scaling):
            g = queries.shape[0] // len(keys)
            out[idx] = []
            for h in range(len(keys)):
                q = queries[h * g:(h + 1) * g].reshape(-1, queries.shape[-1]).float()
                qp = new_pos.repeat(g)
                if q.shape[0] > self.max_queries:
                    pick = torch.randperm(q.shape[0], generator=generator)[:self.max_queries].sort().values
                    q, qp = q[pick], qp[pick]
                out[idx].append((q.clone(), qp.clone()))

        replay(lm, KVCache(lm.model.config, observe_window=0), ids, record)
        return out

    # -- the reference queries' view of the full head ------------------------------------------------
    def _reference_queries(self, head: HeadView) -> tuple[Tensor, Tensor]:
        """(N, D) reference queries of the head and their (N,) positions (`queries=`, the module's docstring)."""
        q = head.queries[:, -self.window:].float()
        qp = head.query_positions[-self.window:]
        if self.queries == "window":
            return q.reshape(-1, q.shape[-1]), qp.repeat(q.shape[0])
        prompt_q, prompt_qp = self._reference[head.layer][head.head]
        after = qp >= self._prompt_len  # observed queries past the replayed prompt: the question, query-aware
        return (torch.cat([prompt_q, q[:, after].reshape(-1, q.shape[-1])]),
                torch.cat([prompt_qp, qp[after].repeat(q.shape[0])]))

    def _logits(self, head: HeadView) -> Tensor:
        """(N, T) logits of the reference queries over the head's rows, row log-weights added, -inf where the
        causal or sliding mask hides a row; queries that see no row are left out."""
        q, qp = self._reference_queries(head)
        logits = (q * head.scaling) @ head.keys.float().T
        if head.log_weights is not None:
            logits = logits + head.log_weights.float()
        allowed = head.positions[None, :] <= qp[:, None]
        if head.sliding_window is not None:
            allowed &= (qp[:, None] - head.positions[None, :]) < head.sliding_window
        logits = logits.masked_fill(~allowed, float("-inf"))
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
        # the ridge's normal equations (t x t): the same solution as a least squares on (N + t, t), far cheaper with
        # the prompt's thousands of queries; ||P||_2^2 is the Gram matrix's largest eigenvalue
        gram = p_kept.T @ p_kept
        lam = self.ridge * float(torch.linalg.eigvalsh(gram)[-1])
        factor, info = torch.linalg.cholesky_ex(gram + lam * torch.eye(chosen.numel(), dtype=torch.float64))
        if lam > 0 and int(info) == 0:
            new_values = torch.cholesky_solve(p_kept.T @ residual, factor)
        else:  # ridge=0, or a system too ill-conditioned to factor: the minimum-norm least squares
            new_values = torch.linalg.lstsq(p_kept, residual, driver="gelsd").solution
        if not torch.isfinite(new_values).all():
            raise KVMemError(f"attention-matching: the value fit of layer {head.layer} head {head.head} is not finite "
                             f"(raise ridge, now {self.ridge})")
        return new_values.to(head.values.dtype), log_weights

"""`keyformer`: a recent window plus the key tokens of a Gumbel-regularised accumulated attention.

Adnan et al. 2024, "Keyformer: KV Cache Reduction through Key Tokens Selection for Efficient Generative Inference"
(MLSys 2024, arXiv 2403.09054; reference code github.com/d-matrix-ai/keyformer-llm, `_attn` in
models/*-keyformer-lib). A key's score is the Keyformer score function summed over the queries of the prompt:
f(x_i) = softmax_i((x_i + z_i) / tau), x the scaled, causally masked attention logits and z standard Gumbel noise
(location 0, scale 1: -log Exp(1), as the reference's `torch.nn.functional.gumbel_softmax` draws it), summed over
every prompt query (`gumbel_score.sum(0).sum(1)`, per head) and, with GQA, averaged over the query heads sharing
the KV head. The budget is split as in the reference: `int(budget * recent_fraction)` (recent=30 %) most recent
tokens, the rest to the top-scoring older ones.

Temperature: the reference's tau = tau_init + t (tau_end - tau_init) / max_new_tokens at decode step t (tau_init 1,
tau_end 2); every prompt query is scored at t = 0, so at tau_init, and the prompt is evicted once, at its end.
kvmem compresses after the prefill: that is the prompt phase, scored at `tau` = tau_init. The decode phase (each
step adds its Gumbel scores over the kept tokens at a rising tau) is not reproduced: it needs the model, so it
cannot run in `Compressor` every N steps. A cache may still be compressed again with `compress` (same scores).

A cache keeps only its last few queries, so the prompt (`context.ids`, from position 0) is run once more on an
empty cache (`replay`: about one more prefill, plus the O(T^2) scoring; memoized in the context). Sliding-window
layers score the logits their window lets a query see. The noise is seeded per (seed, layer, head, query block):
one seed always keeps the same tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, causal_logits, memoized_replay, replay
from kvmem.compress.h2o import H2O
from kvmem.errors import KVMemError

BLOCK = 64  # queries per block: its logits stay in the CPU cache; the noise is drawn block by block


def gumbel(seed: int, layer: int, head: int, start: int, shape: tuple[int, ...]) -> Tensor:
    """Standard Gumbel noise for the queries from `start` of one KV head's group: -log(Exp(1)), as torch's
    gumbel_softmax draws it, from a generator seeded by (seed, layer, head, start)."""
    g = torch.Generator().manual_seed(((seed * 1_000_003 + layer) * 1_009 + head) * 1_000_003 + start)
    return -torch.empty(shape).exponential_(generator=g).log()


class Keyformer(Method):
    name = "keyformer"
    needs_model = True
    select = H2O.select  # the reference's split: the recent window, then the top scores among the older tokens

    def __init__(self, recent_fraction: float = 0.3, tau: float = 1.0, seed: int = 0):
        if not 0 <= recent_fraction < 1:
            raise KVMemError(f"keyformer needs 0 <= recent_fraction < 1; got recent_fraction={recent_fraction}")
        if tau <= 0:
            raise KVMemError(f"keyformer needs tau > 0 (the Gumbel-softmax temperature); got tau={tau}")
        self.recent_fraction, self.tau, self.seed = recent_fraction, float(tau), seed

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        scores = memoized_replay(context, cache, "keyformer", (self.tau, self.seed), self.prompt_scores)
        out = {}
        for i, heads in views.items():
            s = scores[i]
            s = torch.cat([s, s.new_zeros((s.shape[0], cache.get_seq_length() - s.shape[1]))], 1)  # after the prompt: 0
            out[i] = [s[view.head][view.positions.long()] for view in heads]
        return out

    @torch.no_grad()
    def prompt_scores(self, lm, ids: list[int]) -> dict[int, Tensor]:
        """Per layer, (KV heads, len(ids)): the accumulated Gumbel-softmax score of every prompt key."""
        empty = KVCache(lm.model.config, observe_window=0)
        windows = [layer.sliding_window for layer in empty.layers]
        scores = {}

        def record(idx: int, queries: Tensor, keys: list[Tensor], positions: list[Tensor], new_pos: Tensor, scaling: float):
            g = queries.shape[0] // len(keys)
            scores[idx] = torch.stack([self.accumulate(idx, h, queries[h * g:(h + 1) * g], k, p, new_pos, scaling,
                                                       windows[idx]) for h, (k, p) in enumerate(zip(keys, positions))])

        replay(lm, empty, ids, record)
        return scores

    def accumulate(self, layer: int, head: int, queries: Tensor, keys: Tensor, key_pos: Tensor, query_pos: Tensor,
                   scaling: float, window: int | None) -> Tensor:
        """(K,): softmax((logits + Gumbel) / tau) summed over the queries, averaged over the query group."""
        total = torch.zeros(keys.shape[0])
        for s in range(0, queries.shape[1], BLOCK):
            qp = query_pos[s:s + BLOCK]
            end = int(torch.searchsorted(key_pos, qp.max(), right=True))  # later keys are in every query's future
            logits = causal_logits(queries[:, s:s + BLOCK], keys[:end], key_pos[:end], qp, scaling)
            if window is not None:  # what the prefill's sliding window hides
                logits.masked_fill_(key_pos[None, None, :end] <= qp[None, :, None] - window, float("-inf"))
            noisy = (logits + gumbel(self.seed, layer, head, s, tuple(logits.shape))) / self.tau
            total[:end] += noisy.softmax(dim=-1).sum(dim=1).mean(dim=0)
        return total

"""`expected-attention`: the attention future queries are expected to pay, from recent queries' statistics.

Devoto et al. 2025, "Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution" (NVIDIA; kvpress's `ExpectedAttentionPress` is the authors' code). Queries are modelled as
Gaussian: the mean and covariance of the last `window` queries of each query head, taken before RoPE
(kvmem holds them after RoPE and rotates them back by their positions). RoPE is averaged over the next
`n_future` positions, R = mean_t R(t), giving mu' = R mu and S' = R S R^T. For a key k the expected
logit exponent is s mu'.k + s^2/2 k^T S' k (s the attention scaling), so the expected attention is its
softmax over the keys, averaged over the query heads sharing the KV head and multiplied by the value's
norm (what the token can add to the output). The first `n_sink` tokens are kept.

Needs the model for its rotary frequencies (per layer type on Gemma), so it is applied with
`compress(..., context=ModelContext(lm, ids))`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext
from kvmem.errors import KVMemError
from kvmem.rope import rope_frequencies, rotate_half, unrotate


class ExpectedAttention(Method):
    name = "expected-attention"
    needs_model = True
    observe_window = 64

    def __init__(self, window: int = 64, n_future: int = 512, n_sink: int = 4, covariance: bool = True,
                 vnorm: bool = True):
        if window < 2 or n_future < 1 or n_sink < 0:
            raise KVMemError(f"expected-attention needs window >= 2 (a covariance), n_future >= 1 and n_sink >= 0; "
                             f"got window={window}, n_future={n_future}, n_sink={n_sink}")
        self.window, self.n_future, self.n_sink = window, n_future, n_sink
        self.covariance, self.vnorm = covariance, vnorm
        self.observe_window = window

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        out = {}
        for i, heads in views.items():
            freq = rope_frequencies(context.lm.model, i)
            out[i] = [self.expected(view, freq, cache.layers[i].next_position) for view in heads]
        return out

    def expected(self, head: HeadView, freq: Tensor, next_position: int) -> Tensor:
        q = unrotate(head.queries[:, -self.window:].float(), head.query_positions[-self.window:], freq)  # (group, W, D)
        mu = q.mean(dim=1)  # (group, D)
        future = torch.arange(next_position, next_position + self.n_future, dtype=torch.float32)[:, None] * freq[None]
        d = q.shape[-1]
        # R(t) x = x cos + rotate_half(x) sin, a linear map, so its mean over the future positions is
        # diag(mean cos) + diag(mean sin) P with P x = rotate_half(x)
        rot_half = torch.stack([rotate_half(e) for e in torch.eye(d)], dim=1)  # column j = rotate_half(e_j)
        c = torch.cat([future.cos()] * 2, -1).mean(0)
        s = torch.cat([future.sin()] * 2, -1).mean(0)
        rot = torch.diag(c) + s[:, None] * rot_half
        mu = mu @ rot.T
        keys = head.keys.float()
        logits = head.scaling * keys @ mu.T  # (T, group)
        if self.covariance:
            centered = q - q.mean(dim=1, keepdim=True)
            cov = torch.einsum("gwi,gwj->gij", centered, centered) / q.shape[1]
            cov = rot @ cov @ rot.T
            logits = logits + head.scaling ** 2 / 2 * torch.einsum("ti,gij,tj->tg", keys, cov, keys)
        score = logits.softmax(dim=0).mean(dim=1)
        if self.vnorm:
            score = score * head.values.float().norm(dim=-1)
        first = head.positions.min() if head.positions.numel() else 0
        return score.masked_fill(head.positions < first + self.n_sink, float("inf"))

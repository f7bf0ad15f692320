"""`q-filters`: score keys by their projection on one context-agnostic direction per head.

Godey et al. 2025, "Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value Cache Compression"
(arXiv 2503.02812; abstract in shared/seeds; reference code github.com/NathanGodey/qfilters). Queries
and keys of a head share a dominant direction with a consistent sign, so <q, k> is well estimated from
k's projection on it, with no attention computed. Calibration (as the authors' make_filters.py): the
queries after RoPE of each query head over shipped text, `samples` of them drawn at random, SVD; the
first right singular vector v, signed so most queries project positively on it; the filter is -v,
averaged over the query heads that share the KV head. A key's score is minus its projection on the
filter, i.e. keys that the typical query points at are kept.

Filters are fitted once per model fingerprint and cached (`calibration.py`); never downloaded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext
from kvmem.calibration import calibration_ids, load_or_fit
from kvmem.errors import KVMemError


class QFilters(Method):
    name = "q-filters"
    signed_scores = True  # a signed projection on the query direction
    needs_model = True

    def __init__(self, sequences: int = 4, length: int = 1024, samples: int = 3000, seed: int = 0):
        if min(sequences, length, samples) < 1:
            raise KVMemError(f"q-filters needs sequences, length and samples >= 1; got {sequences}, {length}, {samples}")
        self.sequences, self.length, self.samples, self.seed = sequences, length, samples, seed

    def filters(self, lm) -> dict[str, Tensor]:
        params = dict(sequences=self.sequences, length=self.length, samples=self.samples, seed=self.seed)
        return load_or_fit(lm, "q-filters", params, lambda: fit_filters(lm, **params))

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        filters = self.filters(context.lm)
        return {i: [-(view.keys.float() @ filters[f"layer.{i}"][view.head]) for view in heads] for i, heads in views.items()}


@torch.no_grad()
def fit_filters(lm, sequences: int, length: int, samples: int, seed: int) -> dict[str, Tensor]:
    from kvmem.forward import feed

    queries: dict[int, list[Tensor]] = {}
    for ids in calibration_ids(lm.tokenizer, sequences, length):
        cache = KVCache(lm.model.config, observe_window=length)
        feed(lm, cache, ids)
        for i, layer in enumerate(cache.layers):
            queries.setdefault(i, []).append(layer.observation.recent_queries.float())  # (query heads, length, D)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, qs in queries.items():
        q = torch.cat(qs, dim=1)
        q = q[:, torch.randperm(q.shape[1], generator=g)[:samples]]
        u, _, vh = torch.linalg.svd(q, full_matrices=False)
        sign = ((u[..., 0] > 0).float().mean(-1) > 0.5).float() * 2 - 1  # per query head
        filt = -sign[:, None] * vh[:, 0, :]  # (query heads, D)
        n_kv = len(cache.layers[i].lengths())
        out[f"layer.{i}"] = filt.reshape(n_kv, -1, filt.shape[-1]).mean(dim=1)
    return out

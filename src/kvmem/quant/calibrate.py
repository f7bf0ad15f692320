"""Calibration activations for the quantizers that are fitted per model (KVQuant's datatypes and outlier
thresholds, RotateKV's channel order, Coupled Quantization's codebooks).

`calibration_kv(lm)` runs the model over shipped text (the seed abstracts, `calibration_ids`) and returns
each layer's keys and values as the cache receives them (after RoPE), their positions, and optionally the
squared gradients of the language-model loss with respect to them: the diagonal Fisher information that
KVQuant and CQ use to weight their k-means ("sensitivity-weighted"). Fitted artefacts are cached with
`kvmem.calibration.load_or_fit` (stamped with the model fingerprint, refitted on mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import DynamicCache

from kvmem.calibration import calibration_ids
from kvmem.rope import rope_frequencies, unrotate


@dataclass
class LayerActivations:
    keys: Tensor  # (heads, N, head_dim) after RoPE (before it with pre_rope), float32
    values: Tensor  # (heads, N, head_dim)
    positions: Tensor  # (N,) int64, each row's position in its sequence
    key_fisher: Tensor | None = None  # squared loss gradients, same shape as keys (None unless asked)
    value_fisher: Tensor | None = None


def calibration_kv(lm, sequences: int = 2, length: int = 512, fisher: bool = False,
                   pre_rope: bool = False) -> list[LayerActivations]:
    """Per layer, the KV of `sequences` x `length` tokens of the shipped abstracts (rows of all sequences
    joined), with the diagonal Fisher information when `fisher`. With `pre_rope`, keys (and their gradients:
    the rotation is orthogonal, so the gradient un-rotates the same way) are given before RoPE."""
    model = lm.model
    per_layer: dict[int, list] = {}
    for ids in calibration_ids(lm.tokenizer, sequences, length):
        x = torch.tensor([ids], device=model.device)
        captured: dict[int, tuple[Tensor, Tensor]] = {}
        cache = DynamicCache(config=model.config)
        for i, layer in enumerate(cache.layers):
            layer.update = _capturing(layer.update, i, captured, fisher)
        with torch.set_grad_enabled(fisher):
            embeds = model.get_input_embeddings()(x).detach().requires_grad_(fisher)
            out = model(inputs_embeds=embeds, cache=cache, use_cache=True, labels=x if fisher else None)
            if fisher:
                out.loss.backward()
        positions = torch.arange(len(ids))
        for i, (k, v) in captured.items():
            keys, key_grad = k.detach()[0].float(), k.grad[0].float() if fisher else None
            if pre_rope:
                inv_freq = rope_frequencies(model, i)
                keys = unrotate(keys, positions, inv_freq)
                key_grad = unrotate(key_grad, positions, inv_freq) if fisher else None
            grads = (key_grad.square(), v.grad[0].float().square()) if fisher else (None, None)
            per_layer.setdefault(i, []).append((keys, v.detach()[0].float(), *grads))
    out_layers = []
    for i in sorted(per_layer):
        parts = per_layer[i]
        n = parts[0][0].shape[1]
        cat = lambda j: None if parts[0][j] is None else torch.cat([p[j] for p in parts], dim=1)  # noqa: E731
        positions = torch.arange(n).repeat(len(parts))
        out_layers.append(LayerActivations(cat(0), cat(1), positions, cat(2), cat(3)))
    return out_layers


def _capturing(update, layer: int, captured: dict, fisher: bool):
    def capture(key_states: Tensor, value_states: Tensor, *args, **kwargs):
        if fisher:
            key_states.retain_grad()
            value_states.retain_grad()
        captured[layer] = (key_states, value_states)
        return update(key_states, value_states, *args, **kwargs)
    return capture


def weighted_kmeans_1d(x: Tensor, weights: Tensor, k: int, iters: int = 30) -> Tensor:
    """k sorted centroids of the 1-D points x minimising sum(w * (x - c)^2) (Lloyd's algorithm from
    weighted quantiles)."""
    order = x.argsort()
    xs, ws = x[order].double(), weights[order].double().clamp_min(1e-30)
    cdf = ws.cumsum(0) / ws.sum()
    centroids = xs[torch.searchsorted(cdf, (torch.arange(k, dtype=torch.float64) + 0.5) / k).clamp_max(len(xs) - 1)]
    for _ in range(iters):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cell = torch.bucketize(xs, bounds)
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, ws)
        total = torch.zeros(k, dtype=torch.float64).index_add_(0, cell, ws * xs)
        centroids = torch.where(mass > 0, total / mass.clamp_min(1e-30), centroids).sort().values
    return centroids.float()

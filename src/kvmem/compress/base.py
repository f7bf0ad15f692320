"""The shared base of token-eviction methods: score -> budget -> evict.

A method sees one KV head at a time (`HeadView`: its keys, values, positions, the recent queries of
its query group, and accumulated attention when tracked) and returns a score per token; higher is
kept. `compress()` turns a keep ratio into a per-(layer, head) token budget, asks the method which
tokens to keep, and evicts the rest from the `KVCache` for real.

Compression strength is always stated as the fraction of tokens *kept* (keep ratio in (0, 1]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
from torch import Tensor

from kvmem.cache import KVCache, KVLayer
from kvmem.errors import KVMemError

BUDGETS = ("uniform", "adaptive")


@dataclass
class HeadView:
    """What a scorer may look at for one KV head of one layer."""

    layer: int
    head: int
    keys: Tensor  # (T, head_dim), after RoPE
    values: Tensor  # (T, head_dim)
    positions: Tensor  # (T,) original positions, increasing
    queries: Tensor  # (group, W, head_dim): the last W queries of the query heads sharing this KV head
    query_positions: Tensor  # (W,)
    attention: Tensor | None  # (group, T) attention accumulated by every query so far, if tracked
    scaling: float
    sliding_window: int | None

    def query_attention(self, last: int | None = None) -> Tensor:
        """Softmax attention of the last `last` observed queries over this head's keys: (group, last, T)."""
        q = self.queries if last is None else self.queries[:, -last:]
        qp = self.query_positions if last is None else self.query_positions[-last:]
        scores = torch.einsum("gqd,kd->gqk", q, self.keys) * self.scaling
        allowed = self.positions[None, :] <= qp[:, None]
        if self.sliding_window is not None:
            allowed &= (qp[:, None] - self.positions[None, :]) < self.sliding_window
        return scores.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


class Method:
    """Base class of an eviction method. Subclasses set `name` and implement `score` (or `select`)."""

    name: ClassVar[str]
    needs_attention: ClassVar[bool] = False  # needs KVCache(track_attention=True)
    observe_window: ClassVar[int] = 0  # how many recent queries `score` reads

    def score(self, head: HeadView) -> Tensor:
        """(T,) importance per token; the highest `n_keep` are kept."""
        raise NotImplementedError

    def score_layer(self, heads: list[HeadView]) -> list[Tensor]:
        """Scores for all heads of a layer; override when heads must share a decision (e.g. TOVA)."""
        return [self.score(h) for h in heads]

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        """Indices of the tokens to keep. Default: top-`n_keep` by score."""
        return score.topk(n_keep).indices

    def __repr__(self) -> str:
        return self.name


@dataclass
class CompressionResult:
    kv_bytes_before: int
    kv_bytes_after: int
    tokens_before: int
    tokens_after: int

    @property
    def fraction_kept(self) -> float:
        return self.kv_bytes_after / self.kv_bytes_before if self.kv_bytes_before else 1.0


def check_keep_ratio(keep_ratio: float | Sequence[float], n_layers: int) -> list[float]:
    ratios = [float(keep_ratio)] * n_layers if isinstance(keep_ratio, (int, float)) else [float(r) for r in keep_ratio]
    if len(ratios) != n_layers:
        raise KVMemError(f"got {len(ratios)} per-layer keep ratios for a model with {n_layers} layers")
    bad = [r for r in ratios if not (0.0 < r <= 1.0) or math.isnan(r)]
    if bad:
        raise KVMemError(f"keep ratio must be in (0, 1] (the fraction of the KV cache kept); got {bad[0]}")
    return ratios


def head_views(layer: KVLayer, layer_idx: int) -> list[HeadView]:
    groups = layer.recent_queries.shape[0] // layer.num_heads if layer.recent_queries is not None else 0
    views = []
    for h, (keys, values, positions) in enumerate(zip(layer.head_keys, layer.head_values, layer.head_positions)):
        q = layer.recent_queries[h * groups:(h + 1) * groups] if groups else keys.new_zeros((0, 0, 0))
        views.append(HeadView(
            layer=layer_idx, head=h, keys=keys, values=values, positions=positions, queries=q,
            query_positions=layer.recent_positions if groups else positions[:0],
            attention=layer.head_attention[h] if layer.head_attention is not None else None,
            scaling=layer.scaling or 1.0 / math.sqrt(keys.shape[-1]), sliding_window=layer.sliding_window,
        ))
    return views


def _allocate(scores: list[Tensor], budgets: list[int], mode: str) -> list[int]:
    """Tokens each head keeps. `adaptive` (Ada-KV, Feng et al. 2024, arXiv 2407.11550) pools a layer's
    budget across its heads: the layer keeps its top tokens by score whichever head they are in, with
    a floor of 20% of the uniform share per head. Scores are compared as they are, so this is meant for
    methods whose scores are attention weights (h2o, snapkv, tova)."""
    if mode == "uniform":
        return budgets
    floor = [min(max(1, int(0.2 * b)), s.numel()) for b, s in zip(budgets, scores)]
    rest = [s.float().sort(descending=True).values[f:] for s, f in zip(scores, floor)]  # beyond each floor
    owner = torch.cat([torch.full((r.numel(),), h) for h, r in enumerate(rest)])
    extra = owner[torch.cat(rest).topk(min(sum(budgets) - sum(floor), owner.numel())).indices]
    return [f + e for f, e in zip(floor, torch.bincount(extra, minlength=len(scores)).tolist())]


def _check(method: Method, ratios: list[float], budget: str, layer: KVLayer) -> None:
    if method.name == "full" and min(ratios) < 1.0:
        raise KVMemError("method 'full' keeps every token; its keep ratio must be 1.0")
    if budget not in BUDGETS:
        raise KVMemError(f"unknown budget {budget!r}; choose from {', '.join(BUDGETS)}")
    if method.needs_attention and not layer.track_attention:
        raise KVMemError(f"method {method.name!r} needs the cache built with track_attention=True before prefill")
    if method.observe_window and layer.recent_queries is None:
        raise KVMemError(f"method {method.name!r} needs observed queries; the cache has none (observe_window=0?)")


@torch.no_grad()
def compress(
    cache: KVCache,
    method: Method,
    keep_ratio: float | Sequence[float],
    *,
    protect_from: int | None = None,
    budget: str = "uniform",
) -> CompressionResult:
    """Evict tokens from `cache` in place so each layer keeps `keep_ratio` of its compressible tokens.

    Tokens at positions >= `protect_from` (e.g. the question in the query-aware setting) are always kept
    and not counted in the budget. `keep_ratio` may be one float or one per layer. `budget` is `uniform`
    (every head keeps the same fraction) or `adaptive` (heads of a layer share the layer's budget).
    """
    ratios = check_keep_ratio(keep_ratio, len(cache.layers))
    _check(method, ratios, budget, cache.layers[0])
    before = cache.kv_bytes(), sum(map(sum, cache.tokens_held()))
    for layer_idx, ratio in enumerate(ratios):
        compress_layer(cache.layers[layer_idx], layer_idx, method, ratio, protect_from=protect_from, budget=budget)
    return CompressionResult(before[0], cache.kv_bytes(), before[1], sum(map(sum, cache.tokens_held())))


@torch.no_grad()
def compress_layer(layer: KVLayer, layer_idx: int, method: Method, ratio: float, *,
                   protect_from: int | None = None, budget: str = "uniform") -> None:
    """Score, budget and evict one layer (see `compress`)."""
    if ratio >= 1.0 or not layer.is_initialized:
        return
    views = head_views(layer, layer_idx)
    scores = method.score_layer(views)
    budgets, compressible = [], []
    for view in views:
        mask = view.positions < protect_from if protect_from is not None else torch.ones_like(view.positions, dtype=torch.bool)
        compressible.append(mask)
        budgets.append(max(1, math.ceil(ratio * int(mask.sum()))))
    region_scores = [s[m] for s, m in zip(scores, compressible)]
    counts = _allocate(region_scores, budgets, budget)
    keep = []
    for view, score, mask, n_keep in zip(views, scores, compressible, counts):
        region = mask.nonzero().squeeze(1)
        if n_keep >= region.numel():
            chosen = region
        else:
            sub = HeadView(**{**view.__dict__, "keys": view.keys[region], "values": view.values[region],
                              "positions": view.positions[region],
                              "attention": view.attention[:, region] if view.attention is not None else None})
            chosen = region[method.select(sub, score[region], n_keep)]
        keep.append(torch.cat([chosen, (~mask).nonzero().squeeze(1)]))
    layer.keep_only(keep)


class Compressor:
    """Compression run by the cache itself as the model runs, so `model.generate` needs no extra step.

    Each layer is compressed right after its attention has read the first forward (the prefill): the
    rest of that forward is unaffected, exactly as if the whole cache were compressed afterwards. With
    `every=N`, every N later forwards each layer is brought back to the size it had after that.
    Use: `KVCache(config, compressor=Compressor(get_method("snapkv"), 0.25))`.
    """

    def __init__(self, method: Method, keep_ratio: float, every: int = 0, budget: str = "uniform"):
        check_keep_ratio(keep_ratio, 1)
        self.method, self.keep_ratio, self.every, self.budget = method, keep_ratio, every, budget
        self._budget: dict[int, int] = {}  # layer -> max tokens per head after the prefill
        self._steps: dict[int, int] = {}

    def __call__(self, layer: KVLayer, layer_idx: int) -> None:
        if layer_idx not in self._budget:
            _check(self.method, [self.keep_ratio], self.budget, layer)
            compress_layer(layer, layer_idx, self.method, self.keep_ratio, budget=self.budget)
            self._budget[layer_idx], self._steps[layer_idx] = max(layer.lengths()), 0
            return
        self._steps[layer_idx] += 1
        if self.every and self._steps[layer_idx] % self.every == 0:
            ratio = self._budget[layer_idx] / max(layer.lengths())
            if ratio < 1.0:
                compress_layer(layer, layer_idx, self.method, ratio, budget=self.budget)

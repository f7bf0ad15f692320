"""Compression run: a keep ratio turned into per-(layer, head) budgets, the method's scores into the rows kept, and
the rest evicted from the `KVCache` for real (`compress` after a prefill, `Compressor` as the model runs). The
methods themselves are in their own files, on the base in `base.py`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.layer import KVLayer
from kvmem.compress.base import HeadView, Method, ModelContext
from kvmem.compress.budget import BUDGETS, HEAD_SCORED, PROBES, WHOLE_CACHE, allocate
from kvmem.compress.cokv import cokv_values
from kvmem.compress.retrieval_heads import retrieval_scores
from kvmem.errors import KVMemError


@dataclass
class CompressionResult:
    kv_bytes_before: int
    kv_bytes_after: int
    tokens_before: int
    tokens_after: int

    @property
    def fraction_kept(self) -> float:
        return self.kv_bytes_after / self.kv_bytes_before if self.kv_bytes_before else 1.0


def spanned_layers(method: Method, sliding: Sequence[bool]) -> list[int]:
    """The layers `method` compresses, of a model whose layers are sliding-window or not as `sliding` says: all of
    them, or the others when it leaves sliding layers whole (`sliding=keep`). Per-layer budgets span these."""
    return [i for i, s in enumerate(sliding) if not (s and method.sliding == "keep")]


def check_keep_ratio(keep_ratio: float | Sequence[float], n_layers: int) -> list[float]:
    ratios = [float(keep_ratio)] * n_layers if isinstance(keep_ratio, (int, float)) else [float(r) for r in keep_ratio]
    if len(ratios) != n_layers:
        raise KVMemError(f"got {len(ratios)} per-layer keep ratios for a model with {n_layers} layers")
    bad = [r for r in ratios if not (0.0 < r <= 1.0) or math.isnan(r)]
    if bad:
        raise KVMemError(f"keep ratio must be in (0, 1] (the fraction of the KV cache kept); got {bad[0]}")
    return ratios


def head_views(layer: KVLayer, layer_idx: int) -> list[HeadView]:
    seen = layer.observation
    groups = seen.recent_queries.shape[0] // layer.num_heads if seen.recent_queries is not None else 0
    views = []
    for h, (keys, values, positions) in enumerate(layer.rows.heads()):
        q = seen.recent_queries[h * groups:(h + 1) * groups] if groups else keys.new_zeros((0, 0, 0))
        views.append(HeadView(
            layer=layer_idx, head=h, keys=keys, values=values, positions=positions, queries=q,
            query_positions=seen.recent_positions if groups else positions[:0],
            attention=seen.head_attention[h] if seen.head_attention is not None else None,
            scaling=seen.scaling or 1.0 / math.sqrt(keys.shape[-1]), sliding_window=layer.sliding_window,
            log_weights=layer.log_weights[h] if layer.log_weights is not None else None,
        ))
    return views


def refits_rows(method: Method) -> bool:
    """Whether `method` rewrites the kept rows after selection (`Method.refit`)."""
    return type(method).refit is not Method.refit


def _check(method: Method, ratios: list[float], layer: KVLayer, context: ModelContext | None = None) -> None:
    if method.name == "full" and min(ratios) < 1.0:
        raise KVMemError("method 'full' keeps every token; its keep ratio must be 1.0")
    if method.budget not in BUDGETS:
        raise KVMemError(f"unknown budget {method.budget!r}; choose from {', '.join(BUDGETS)}")
    if refits_rows(method) and method.budget == "razor":  # refit log-weights already stand for the dropped tokens
        raise KVMemError(f"method {method.name!r} refits the kept rows for what was dropped; budget 'razor' would add "
                         "compensation rows for the same tokens: choose another budget")
    if refits_rows(method) and (layer.quant is not None or hasattr(layer.rows, "demote")):
        raise KVMemError(f"method {method.name!r} rewrites the kept rows' values and log-weights; this cache holds "
                         "quantized or mixed-precision rows: compress a full-precision cache, then quantize it")
    seen = layer.observation
    if method.needs_attention and not seen.track_attention:
        raise KVMemError(f"method {method.name!r} needs the cache built with track_attention=True before prefill")
    if method.needs_attention and seen.decay != method.attention_decay:  # a plain sum is not a momentum, nor back
        raise KVMemError(f"method {method.spec!r} reads attention accumulated with decay {method.attention_decay:g} "
                         f"a step; this cache tracks it with decay {seen.decay:g}: build it with "
                         "kvmem.generate.new_cache(lm, method) or KVCache(..., attention_decay=...)")
    if method.decode_phase and refits_rows(method):
        raise KVMemError(f"method {method.name!r}: refitting rows is not supported for decode-phase methods")
    if method.decode_budget is not None and min(ratios) < 1.0:
        raise KVMemError(f"method {method.spec!r} keeps a fixed decode_budget={method.decode_budget} generated rows per "
                         f"head; the keep ratio must then be 1.0 (got {min(ratios)}): give one or the other")
    if method.observe_window and (seen.recent_queries is None or seen.window < method.observe_window):
        raise KVMemError(f"method {method.spec!r} reads the last {method.observe_window} queries; the cache keeps "
                         f"{seen.window if seen.recent_queries is not None else 0} (KVCache(observe_window=...))")
    if (method.needs_model or method.budget in HEAD_SCORED) and context is None:
        why = (f"method {method.name!r} needs the model (it reruns it, or reads its RoPE or calibration)"
               if method.needs_model else f"budget {method.budget!r} needs the model (its head scores are fitted for it)")
        raise KVMemError(f"{why}: pass context=ModelContext(lm, ids) (the token ids the cache holds)")


@torch.no_grad()
def compress(
    cache: KVCache,
    method: Method,
    keep_ratio: float | Sequence[float],
    *,
    protect_from: int | None = None,
    context: ModelContext | None = None,
) -> CompressionResult:
    """Evict tokens from `cache` in place so each layer keeps `keep_ratio` of its compressible tokens,
    shared among heads by the method's budget.

    Tokens at positions >= `protect_from` (e.g. the question in the query-aware setting) are always kept
    and not counted in the budget. `keep_ratio` may be one float or one per layer. `context` is needed by
    methods that run the model (`method.needs_model`).
    """
    ratios = check_keep_ratio(keep_ratio, len(cache.layers))
    if getattr(method, "offloads", False):  # offload-and-retrieve (compress/offload/): nothing is dropped
        return method.offload(cache, ratios, context, protect_from)
    _check(method, ratios, cache.layers[0], context)
    if method.sliding == "keep":
        ratios = [1.0 if layer.is_sliding else r for r, layer in zip(ratios, cache.layers)]
    before = cache.kv_bytes(), sum(map(sum, cache.tokens_held()))
    cap = method.decode_budget  # a decode-phase method's fixed budget replaces the ratio
    layers = {i: layer for i, layer in enumerate(cache.layers)
              if (ratios[i] < 1.0 or (cap is not None and not (layer.is_sliding and method.sliding == "keep")))
              and layer.is_initialized}
    prompt_ends = None
    if method.decode_phase:
        prompt_ends = {i: layer.observation.prompt_end for i, layer in layers.items()}
        if None in prompt_ends.values():
            raise KVMemError(f"method {method.name!r} compresses the rows generated after the prompt, and this cache "
                             "has recorded no forward (its prompt) since its rows were built or loaded")
        # only layers holding generated rows have anything to compress (a prompt alone is kept whole)
        layers = {i: layer for i, layer in layers.items()
                  if any(int(p[-1]) >= prompt_ends[i] for p in layer.head_positions if p.numel())}
    if layers:
        views = {i: head_views(layer, i) for i, layer in layers.items()}
        if context is not None:
            context.keep_ratios = ratios
        scores = method.score_cache(views, cache, context)
        head_scores = None
        if method.budget in HEAD_SCORED:
            probe = cokv_values(context.lm) if method.budget == "cokv" else retrieval_scores(context.lm, PROBES[method.budget])
            head_scores = {i: probe[f"layer.{i}"] for i in layers}
        spanned = spanned_layers(method, [layer.is_sliding for layer in cache.layers])
        evict(layers, views, scores, method, {i: ratios[i] for i in layers}, spanned, protect_from, head_scores,
              prompt_ends, cap)
    return CompressionResult(before[0], cache.kv_bytes(), before[1], sum(map(sum, cache.tokens_held())))


def evict(layers: dict[int, KVLayer], views: dict[int, list[HeadView]], scores: dict[int, list[Tensor]], method: Method,
          ratios: dict[int, float], spanned: Sequence[int], protect_from: int | None = None,
          head_scores: dict[int, Tensor] | None = None, protect_before: dict[int, int] | None = None,
          cap: int | None = None) -> None:
    """Budget and evict: each head keeps its allocated number of compressible tokens, chosen by
    `method.select`, plus every protected token: those at positions >= `protect_from` and, per layer, those
    before `protect_before[layer]` (a decode-phase method's prompt). `cap`: each head's share is this many
    compressible tokens (at most all of them) instead of the ratio's."""
    def span(h: HeadView, layer: int) -> tuple[int, int]:
        # positions increase along a head, so the compressible tokens (from `protect_before` to `protect_from`)
        # are a contiguous range of rows
        def at(p: int) -> int:
            return int(torch.searchsorted(h.positions, torch.tensor(p, dtype=h.positions.dtype)))
        lo = at(protect_before[layer]) if protect_before is not None else 0
        hi = at(protect_from) if protect_from is not None else h.positions.numel()
        return lo, max(lo, hi)

    spans = {i: [span(h, i) for h in heads] for i, heads in views.items()}
    sizes = {i: [hi - lo for lo, hi in spans[i]] for i in views}
    shares = {i: [max(1, math.ceil(ratios[i] * n) if cap is None else min(cap, n)) for n in sizes[i]] for i in views}
    aligned = {i: all(n == sizes[i][0] and torch.equal(h.positions[lo:hi], heads[0].positions[spans[i][0][0]:spans[i][0][1]])
                      for h, n, (lo, hi) in zip(heads, sizes[i], spans[i])) for i, heads in views.items()}
    compressible = {i: [s[lo:hi] for s, (lo, hi) in zip(scores[i], spans[i])] for i in views}
    counts = method.counts(compressible, shares) if method.budgets == () else \
        allocate(method.budget, compressible, shares, spanned, head_scores, aligned)
    # a razor compensation token takes a slot of its head's share; when the shares leave none (a context of a few
    # tokens, every head at its one-row minimum) no compensation token is added, so the budget still holds
    compensate = method.budget == "razor" and sum(
        min(c, n) + (c < n and not layers[i].is_sliding) for i in views for c, n in zip(counts[i], sizes[i])
    ) <= sum(map(sum, shares.values()))
    refits = refits_rows(method)
    for i, layer in layers.items():
        keep, compensation, refit = [], [], []
        for view, score, (lo, n), n_keep in zip(views[i], scores[i], spans[i], counts[i]):
            region = torch.arange(lo, n)
            protected = torch.cat([torch.arange(lo), torch.arange(n, view.positions.numel())])
            fitted = None
            if n_keep >= n - lo:
                chosen = region
            else:  # slices, not copies: the scorer sees the compressible rows
                sub = HeadView(**{**view.__dict__, "keys": view.keys[lo:n], "values": view.values[lo:n],
                                  "positions": view.positions[lo:n],
                                  "attention": view.attention[:, lo:n] if view.attention is not None else None,
                                  "log_weights": view.log_weights[lo:n] if view.log_weights is not None else None})
                chosen = method.select(sub, score[lo:n], n_keep) + lo
                if refits:  # sorted, so the refit rows line up with the kept rows keep_only leaves in position order
                    chosen = chosen.sort().values  # (lo is 0 here: _check refuses refits with a protected prompt)
                    fitted = method.refit(view, chosen, n)
            keep.append(torch.cat([chosen, protected]))
            refit.append(fitted if fitted is None else (torch.cat([fitted[0], view.values[n:].to(fitted[0].dtype)]),
                                                        torch.cat([fitted[1], _weights(view)[n:]])))
            compensation.append(_compensation(view, region, chosen) if compensate and not layer.is_sliding else None)
        layer.keep_only(keep)
        if any(r is not None for r in refit):
            layer.refit_rows([r if r is None else r[0] for r in refit], [r if r is None else r[1] for r in refit])
        if any(row is not None for row in compensation):
            layer.add_rows(compensation)


def _weights(view: HeadView) -> Tensor:
    """The head's row log-weights, zeros where each row is one token."""
    if view.log_weights is not None:
        return view.log_weights.float()
    return torch.zeros(view.positions.numel(), dtype=torch.float32, device=view.keys.device)


def _compensation(view: HeadView, region: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor, int, float] | None:
    """RazorAttention's compensation token for what a head dropped: mean key and value, standing for all of
    them (log-weight log n); at the last dropped position, so it stays visible as long as they would."""
    dropped = region[~torch.isin(region, chosen)]
    if dropped.numel() == 0:
        return None
    return (view.keys[dropped].float().mean(0), view.values[dropped].float().mean(0),
            int(view.positions[dropped].max()), math.log(dropped.numel()))


class Compressor:
    """Compression run by the cache itself as the model runs, so `model.generate` needs no extra step.

    Each layer is compressed right after its attention has read the first forward (the prefill): the
    rest of that forward is unaffected, exactly as if the whole cache were compressed afterwards. With
    `every=N`, every N later forwards each layer is brought back to the size it had after that, plus `extra_rows`
    (default 0): `Compressor(method, 1.0, every=1, extra_rows=64)` keeps the prompt whole and then holds each head at the
    prompt's rows + 64, evicting by the method's score among everything held (a fixed decode-time budget).
    A decode-phase method (`Method.decode_phase`, Moment-KV) leaves the prefill whole; every N later forwards each
    head keeps its prompt rows plus ceil(keep ratio x tokens generated so far) of the generated rows, or the method's
    fixed `decode_budget` of them (keep ratio 1.0 then), which `extra_rows` also sets.
    Use: `KVCache(config, compressor=Compressor(get_method("snapkv"), 0.25))`; each cache works on its own
    copy (`bind`), so one Compressor serves any number of caches. Layer by layer, so budgets
    that compare layers (`global`, `duo`) and methods that need the model (`kvzip`) are applied with `compress()`
    after the prefill instead; `model.generate` then continues from that cache.
    """

    def __init__(self, method: Method, keep_ratio: float, every: int = 0, extra_rows: int = 0):
        check_keep_ratio(keep_ratio, 1)
        if not isinstance(every, int) or every < 0 or not isinstance(extra_rows, int) or extra_rows < 0:
            raise KVMemError(f"Compressor: every and extra_rows must be integers >= 0; got every={every!r}, "
                             f"extra_rows={extra_rows!r}")
        if extra_rows and not every:
            raise KVMemError(f"Compressor: extra_rows={extra_rows} bounds the rows decoding adds, so it needs every=N "
                             "(how often the layer is brought back to its budget)")
        if getattr(method, "offloads", False):
            raise KVMemError(f"{method.name} offloads a prefilled cache, once: prefill, then call "
                             "kvmem.compress.compress(cache, method, ratio, context=...) (or kvmem.generate.answer)")
        if method.needs_model or method.budget in WHOLE_CACHE:
            what = (f"method {method.name!r} needs the model" if method.needs_model
                    else f"budget {method.budget!r} compares heads of all layers")
            raise KVMemError(f"{what}, so it cannot compress layer by layer as the model runs: prefill, then call "
                             "kvmem.compress.compress(cache, method, ratio, context=...), then generate from the cache")
        if extra_rows and method.decode_phase and method.decode_budget not in (None, extra_rows):
            raise KVMemError(f"method {method.spec!r} keeps decode_budget={method.decode_budget} generated rows; "
                             f"extra_rows={extra_rows} says otherwise: give one of them")
        self.method, self.keep_ratio, self.every, self.extra_rows = method, keep_ratio, every, extra_rows
        self.spanned: list[int] = []  # set by bind(): the layers the method compresses
        self._budget: dict[int, int] = {}  # layer -> max tokens per head after the prefill
        self._steps: dict[int, int] = {}

    def bind(self, sliding: Sequence[bool]) -> "Compressor":
        """A fresh copy for one cache whose layers are sliding-window or not as `sliding` says (the state is per
        cache)."""
        bound = Compressor(self.method, self.keep_ratio, self.every, self.extra_rows)
        bound.spanned = spanned_layers(self.method, sliding)
        return bound

    def _compress(self, layer: KVLayer, layer_idx: int, ratio: float, prompt_end: int | None = None,
                  cap: int | None = None) -> None:
        views = {layer_idx: head_views(layer, layer_idx)}
        evict({layer_idx: layer}, views, {layer_idx: self.method.score_layer(views[layer_idx])}, self.method,
              {layer_idx: ratio}, self.spanned, protect_before=None if prompt_end is None else {layer_idx: prompt_end},
              cap=cap)

    def _compress_generated(self, layer: KVLayer, layer_idx: int) -> None:
        """A decode-phase method: the prompt's rows stay; each head keeps `decode_budget` of the rows generated since,
        or ceil(keep ratio x the tokens generated so far), so rounds of compression do not compound."""
        end = layer.observation.prompt_end
        generated = layer.next_position - end
        cap = self.method.decode_budget or self.extra_rows or math.ceil(self.keep_ratio * generated)
        if max(int((p >= end).sum()) for p in layer.head_positions) > cap:
            self._compress(layer, layer_idx, 1.0, end, cap)

    def __call__(self, layer: KVLayer, layer_idx: int) -> None:
        if layer.is_sliding and self.method.sliding == "keep":
            return
        if layer_idx not in self._budget:
            _check(self.method, [self.keep_ratio], layer)
            if self.keep_ratio < 1.0 and not self.method.decode_phase:  # a decode-phase method keeps the prompt whole
                self._compress(layer, layer_idx, self.keep_ratio)
            self._budget[layer_idx], self._steps[layer_idx] = _budgeted_rows(layer) + self.extra_rows, 0
            return
        self._steps[layer_idx] += 1
        if self.every and self._steps[layer_idx] % self.every == 0:
            if self.method.decode_phase:
                self._compress_generated(layer, layer_idx)
                return
            ratio = self._budget[layer_idx] / max(layer.lengths())  # select the budget among every row held
            if ratio < 1.0:
                self._compress(layer, layer_idx, ratio)


def compress_while_decoding(cache: KVCache, method: Method, keep_ratio: float,
                            prompt_end: int | None = None) -> None:
    """Make a cache that has read its prompt evict as it decodes, for a decode-phase method (Moment-KV): from the next
    forward on, each head keeps every row before `prompt_end` (default: the position the cache has reached, i.e. its
    whole prompt) and ceil(keep_ratio x tokens generated) of the later rows, or the method's `decode_budget`, chosen
    by the method at every forward. What `answer`, `kvmem generate` and the server do for such a method (their
    prefill may run in pieces, so the prompt's end is set here, not taken from the first forward); `Compressor` in
    `KVCache(compressor=...)` does the same from a cache's first forward."""
    if not method.decode_phase:
        raise KVMemError(f"method {method.spec!r} compresses the prompt: use compress(), not compress_while_decoding")
    seen = cache.layers[0].observation
    if not seen.track_attention or seen.decay != method.attention_decay:
        raise KVMemError(f"method {method.spec!r} scores rows by attention decayed by {method.attention_decay:g} per step; "
                         "this cache does not track it (make it with kvmem.generate.new_cache(lm, method))")
    compressor = Compressor(method, keep_ratio, every=1).bind([layer.is_sliding for layer in cache.layers])
    for i, layer in enumerate(cache.layers):
        layer.compressor = compressor
        layer.observation.prompt_end = layer.next_position if prompt_end is None else prompt_end
        compressor._budget[i], compressor._steps[i] = _budgeted_rows(layer), 0  # the prompt is read: decoding follows


def _budgeted_rows(layer: KVLayer) -> int:
    """The most rows a head of `layer` holds that count against the budget: all of them, or, where evicted rows
    are demoted instead (mixed precision, quant/mikv.py), the high-precision ones."""
    if hasattr(layer.rows, "split"):
        return max((len(high) for high, _ in layer.rows.split()), default=0)
    return max(layer.lengths())

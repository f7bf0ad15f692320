"""Budget allocators: how many tokens each (layer, KV head) keeps, given every head's scores.

Any scorer composes with any allocator (`snapkv:budget=pyramid`, `kvzip:budget=adaptive`). Each gets the
scores of the compressible tokens per layer and head, and each head's uniform share (ceil(keep ratio x its
compressible tokens)); it returns the count per head. All but `uniform` compare scores, so they suit
scorers whose scores are comparable across heads (attention weights: h2o, snapkv, tova, kvzip,
expected-attention).

* `uniform`: every head keeps its share.
* `adaptive` (Ada-KV, Feng et al. 2024, arXiv 2407.11550): a layer's heads pool the layer's budget; the
  layer keeps its top tokens by score whichever head they are in, with a floor of 20 % of the share per head.
* `pyramid` (PyramidKV, Cai et al. 2024, arXiv 2406.02069): lower layers keep more, higher layers less,
  linearly; the top layer keeps share/beta, and the mean over layers is the share (the formula of the
  reference implementation, KVCache-Factory, without its observation-window term: kvmem's scorers that
  have a window keep it through their scores). kvmem gives each layer one token first and shapes the
  rest, rounded cumulatively: the layers' total never exceeds the shares, even for a few-token context.
  The slope spans the layers the method compresses: with `sliding=keep` on Gemma-3, its 3 global layers, not
  all 18 (spanning all 18 left the global layers 0.35 / 0.18 / 0.01 of their rows at keep 0.25, 72 % of the
  budget, and put the steepest drop between layers that keep everything).
* `global` (KVzip, Kim et al. 2025, arXiv 2505.23416): one threshold over every head of every layer, so
  layers and heads keep what their scores earn. Needs the whole cache at once.
* `duo` (DuoAttention, Xiao et al. 2024, arXiv 2410.10819): retrieval heads keep everything, the other
  ("streaming") heads share what is left, at least `STREAMING_MIN` tokens each, chosen by the scorer:
  `streaming-llm:budget=duo` is DuoAttention's sinks + recent window. The keep ratio sets how many heads
  can be retrieval heads: heads are taken in the order of a needle-copy probe (`retrieval_heads.py`,
  fitted once per model) while the budget allows. Needs the whole cache and the model.
* `razor` (RazorAttention, Tang et al. 2024, arXiv 2407.15891): the same split, with heads ranked by
  Razor's echo/induction probe, and each streaming head of a full-attention layer keeps one more row, a
  compensation token: the mean key and value of what it dropped, weighted by how many it stands for
  (`evict` adds it; its slot is taken from the head's share).
* `prefixkv` (PrefixKV, Wang et al. 2024, arXiv 2412.03409): every layer keeps the shortest prefix of its tokens,
  ranked by score, that holds a fraction p of the layer's score mass (its normalized cumulative curve), with one p
  for every layer, found by binary search so that the layers together keep the shares' total (the reference's
  `obtain_cdf_num`, then its proportional rounding). A layer's heads keep the same count; its curve is the heads'
  mean score per token, as in the reference, when the heads hold the same tokens (after a prefill), and the mean of
  the heads' own curves when they do not. The reference fits the per-layer ratios on profiled samples and averages
  them; kvmem searches them for each prompt (the reference's profiling step, on the prompt being compressed).
  Scores must be non-negative (a mass): scorers with signed scores (`Method.signed_scores`: knorm, keydiff,
  q-filters) are refused by `get_method`; tokens a scorer always keeps (+inf) count first, unseen ones (-inf) hold none.
* `cokv` (CoKV, Sun et al. 2025, arXiv 2502.17501; `cokv.py`): each KV head's importance is its Sliced Shapley value
  in the cooperative game of inference (a coalition's heads keep their cache, the others a local window; the value
  is the model's log-likelihood on shipped text), fitted once per model; every head keeps a window of 32 tokens,
  the rest of the total goes to the heads in proportion to their values minus the smallest. Needs the whole cache
  and the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kvmem.compress.cokv import cokv_counts
from kvmem.errors import KVMemError

BUDGETS = ("uniform", "adaptive", "pyramid", "global", "duo", "razor", "prefixkv", "cokv")
WHOLE_CACHE = ("global", "duo", "razor", "prefixkv", "cokv")  # budgets that compare heads of different layers
PROBES = {"duo": "needle-copy", "razor": "echo-induction"}  # how each ranks retrieval heads (retrieval_heads.py)
HEAD_SCORED = (*PROBES, "cokv")  # budgets that rank heads by scores fitted for the model (`head_scores`)
STREAMING_MIN = 64
ADAPTIVE_FLOOR = 0.2
PYRAMID_BETA = 20


def allocate(budget: str, scores: dict[int, list[Tensor]], shares: dict[int, list[int]], spanned: Sequence[int],
             head_scores: dict[int, Tensor] | None = None, aligned: dict[int, bool] | None = None) -> dict[int, list[int]]:
    """Tokens each head keeps: {layer: [count per KV head]} for the layers in `scores`. `spanned`: the layers the
    method compresses, in order (every layer, or the global ones when sliding layers are kept whole): `pyramid`
    shapes its slope over them, so that their mean is the share. `head_scores` ranks
    heads for `duo` and `razor` (their probe's retrieval scores per layer) and sizes them for `cokv` (their fitted
    values); `aligned` says which layers' heads hold
    the same tokens in the same order (`prefixkv` averages their scores per token there)."""
    if budget == "uniform":
        return shares
    if budget == "adaptive":
        return {layer: _pool(scores[layer], shares[layer], ADAPTIVE_FLOOR) for layer in scores}
    if budget == "pyramid":
        spanned = list(spanned)
        return {layer: _pyramid(shares[layer], [s.numel() for s in scores[layer]], spanned.index(layer), len(spanned))
                for layer in scores}
    if budget in PROBES:
        return _retrieval_heads_first(scores, shares, head_scores, reserve=1 if budget == "razor" else 0)
    if budget == "global":
        layers = sorted(scores)
        flat = _pool([s for layer in layers for s in scores[layer]], [b for layer in layers for b in shares[layer]], 0.0)
        out, i = {}, 0
        for layer in layers:
            out[layer], i = flat[i:i + len(scores[layer])], i + len(scores[layer])
        return out
    if budget == "prefixkv":
        return _prefixkv(scores, shares, aligned or {})
    if budget == "cokv":
        return cokv_counts({layer: [s.numel() for s in scores[layer]] for layer in scores}, shares, head_scores)
    raise KVMemError(f"unknown budget {budget!r}; choose from {', '.join(BUDGETS)}")


def _pool(scores: list[Tensor], shares: list[int], floor_fraction: float) -> list[int]:
    """The heads share sum(shares): each keeps a floor, the rest goes to the highest scores anywhere."""
    floor = [min(max(1, int(floor_fraction * b)), s.numel()) for b, s in zip(shares, scores)]
    rest = [s.float().sort(descending=True).values[f:] for s, f in zip(scores, floor)]  # beyond each floor
    owner = torch.cat([torch.full((r.numel(),), h) for h, r in enumerate(rest)])
    extra = owner[torch.cat(rest).topk(min(sum(shares) - sum(floor), owner.numel())).indices]
    return [f + e for f, e in zip(floor, torch.bincount(extra, minlength=len(scores)).tolist())]


def _pyramid(shares: list[int], sizes: list[int], layer: int, n_layers: int) -> list[int]:
    """Per head of the `layer`-th of `n_layers` spanned layers: one token, plus the rest of the share shaped as a
    pyramid over the layers (top = rest/beta,
    mean = rest), rounded cumulatively over the layers, so that every layer gets at least one token and the
    layers together never exceed their shares, while each layer is still computed on its own."""
    out = []
    for share, size in zip(shares, sizes):
        rest = share - 1
        low = rest / PYRAMID_BETA
        high = 2 * rest - low
        if 1 + high > size:  # the bottom layer cannot keep more than it holds: the slope flattens
            high, low = size - 1, 2 * rest - (size - 1)
        step = (high - low) / (n_layers - 1) if n_layers > 1 else 0.0

        def below(n: int) -> float:  # tokens of layers 0..n-1 together: sum of 1 + high - j * step
            return n * (1 + high) - step * n * (n - 1) / 2

        count = math.floor(below(layer + 1) + 1e-9) - math.floor(below(layer) + 1e-9)
        out.append(min(size, max(1, count)))
    return out


def _retrieval_heads_first(scores: dict[int, list[Tensor]], shares: dict[int, list[int]],
                           head_scores: dict[int, Tensor], reserve: int = 0) -> dict[int, list[int]]:
    """Retrieval heads keep everything, streaming heads share the rest (`reserve` rows each left free)."""
    heads = [(layer, h) for layer in sorted(scores) for h in range(len(scores[layer]))]
    size = {(layer, h): scores[layer][h].numel() for layer, h in heads}
    total = sum(sum(shares[layer]) for layer in scores)
    order = sorted(heads, key=lambda lh: -float(head_scores[lh[0]][lh[1]]))
    full, used = set(), 0
    for lh in order:  # the best-ranked heads keep everything while the others can still keep STREAMING_MIN
        rest = len(heads) - len(full) - 1
        if float(head_scores[lh[0]][lh[1]]) <= 0 or used + size[lh] + rest * STREAMING_MIN > total:
            break
        full.add(lh)
        used += size[lh]
    streaming = [lh for lh in heads if lh not in full]
    each = (total - used) // max(len(streaming), 1)
    out = {layer: [0] * len(scores[layer]) for layer in scores}
    for lh in heads:
        out[lh[0]][lh[1]] = size[lh] if lh in full else max(1, min(size[lh], each - reserve))
    return out


def _layer_curve(heads: list[Tensor], aligned: bool) -> tuple[int, Tensor]:
    """(tokens kept whatever p is, the cumulative share of score mass held by the top 1, 2, ... of the others)."""
    heads = [h.masked_fill(h == float("-inf"), 0.0) for h in heads]  # a key no query could see carries no mass
    if any(bool((h < 0).any()) or bool(h.isnan().any()) for h in heads):
        raise KVMemError("budget=prefixkv sizes layers by their share of attention mass: it needs a scorer whose scores "
                         "are non-negative (h2o, snapkv, tova, expected-attention, kvzip, ...)")

    def curve(s: Tensor) -> tuple[int, Tensor]:
        finite = s[~s.isinf()].double()
        ranked = finite.sort(descending=True).values.cumsum(0)
        return s.numel() - finite.numel(), ranked / ranked[-1] if ranked.numel() and ranked[-1] > 0 else \
            torch.linspace(1, finite.numel(), finite.numel(), dtype=torch.double) / max(finite.numel(), 1)

    if aligned:
        return curve(torch.stack([h.float() for h in heads]).mean(dim=0))
    parts = [curve(h.float()) for h in heads]
    longest = max(c.numel() for _, c in parts)
    padded = torch.stack([torch.cat([c, c.new_ones(longest - c.numel())]) for _, c in parts])
    return max(m for m, _ in parts), padded.mean(dim=0)


def _prefixkv(scores: dict[int, list[Tensor]], shares: dict[int, list[int]], aligned: dict[int, bool]) -> dict[int, list[int]]:
    """One retention level p for every layer (binary search), each layer keeping the tokens that reach it."""
    layers = sorted(scores)
    total = sum(sum(shares[layer]) for layer in layers)
    size = {layer: min(s.numel() for s in scores[layer]) for layer in layers}
    heads = {layer: len(scores[layer]) for layer in layers}
    curves = {layer: _layer_curve(scores[layer], aligned.get(layer, False)) for layer in layers}

    def kept(p: float) -> dict[int, int]:  # per head of each layer: its always-kept tokens + the prefix reaching p
        out = {}
        for layer, (must, curve) in curves.items():
            reach = int(torch.searchsorted(curve, torch.tensor([p], dtype=curve.dtype))[0]) + 1 if curve.numel() else 0
            out[layer] = min(size[layer], max(1, must + min(reach, curve.numel())))
        return out

    def count(k: dict[int, int]) -> int:
        return sum(heads[layer] * n for layer, n in k.items())

    lo, hi = 0.0, 1.0
    for _ in range(50):  # the reference stops within 5 tokens; kvmem rounds to the exact total below
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if count(kept(mid)) <= total else (lo, mid)
    k = kept(lo)
    # the reference's last step: scale every layer's count to the exact total, keeping each within [1, size]
    scale = total / max(count(k), 1)
    exact = {layer: min(size[layer], max(1.0, n * scale)) for layer, n in k.items()}
    out = {layer: int(x) for layer, x in exact.items()}
    for layer in sorted(layers, key=lambda layer: out[layer] - exact[layer]):  # largest remainders first
        if count(out) + heads[layer] > total:
            continue
        if out[layer] < size[layer] and exact[layer] > out[layer]:
            out[layer] += 1
    return {layer: [out[layer]] * heads[layer] for layer in layers}

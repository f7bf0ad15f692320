"""`budget=cokv`: head budgets from each KV head's Sliced Shapley value in the cooperative game of inference.

Sun et al. 2025, "CoKV: Optimizing KV Cache Allocation via Cooperative Game" (arXiv 2502.17501; reference code
github.com/nawei1010/CoKV: `cal_global_sv.py` / `cc_score_evaluation.py` fit, `set_cokv_size` / `set_cc_size`
allocate). The players are the KV heads (the reference's GQA groups: 32 layers x 8 groups for Llama-3-8B).

**Fit (once per model fingerprint, cached by `calibration.load_or_fit`).** A coalition S is valued by the model's
performance when the heads in S keep their whole cache and every other head keeps only its last `window` = 8
context tokens (the reference's importance evaluation sets window_size 8 and gives coalition heads a size larger
than any context). The Sliced Shapley value is estimated as the reference does, by complementary contributions:
draw a random S of size s, evaluate u(S) and u(N \\ S), and credit u(S) - u(N \\ S) to every head in S
(`cc_left`; the credit to the complement, `cc_right`, is recorded by the reference but not used). A head's value
is the sum over the slice sizes of its mean credit at that size (`Avg_cc += cc_left / count_left`). The slice is
the reference's: coalitions of n/8, 2n/8, 3n/8 and 4n/8 of the n heads (32, 64, 96, 128 of Llama's 256),
rounded, at least 1.

Departures, and why:
* The value u is not a LongBench score (F1 of generated answers on the task's validation set, one value table per
  dataset): nothing is downloaded, and generated-answer F1 on a few local samples is too coarse to rank 18-90
  heads. kvmem's u is the mean log-likelihood of a continuation of the shipped abstracts (`data/abstracts.txt`):
  `sequences` = 1 sequence of `context` = 192 tokens read into the cache, compressed by the coalition mask, then the
  next `continuation` = 32 tokens teacher-forced; the first of them is predicted by the uncompressed prefill and
  does not count. One prefill serves every coalition (a copy of its cache is masked).
* Samples: the reference draws up to 10,000 coalitions per slice size on 4 GPUs; kvmem draws `samples` = 64 per
  size (256 coalitions, 512 evaluations of 31 tokens), so that one fit takes minutes on two CPU cores. Each head is
  credited about samples x k / 8 times at slice k whatever the model's head count (8 to 32 times). The estimator is
  noisy at this count, and the allocation inherits it: the spread is measured at fit time as the Spearman rank
  correlation between the values computed from the even and from the odd samples (split-half, stored in the
  artefact as `split_half_spearman`; the full estimate's reliability is about 2r / (1 + r)). Measured with the
  defaults (1 torch thread, on a machine shared with other jobs): SmolLM2-135M (90 heads) 0.40, fit 281 s;
  Gemma-3-270M (18 heads) 0.86, fit 324 s; Qwen2.5-Coder-0.5B (48 heads) 0.18, fit 512 s; on SmolLM2, 48 samples
  with two sequences gave 0.16. The values of many
  heads are close, so their order is noise; the heads far above or below stand out. A difference-of-means estimator
  that also uses the samples where a head is outside S (same expectation) reached only 0.40, so the reference's
  estimator is kept. More samples (`cokv_values(lm, samples=...)`) buy reliability at a linear cost.
* A head that drew no sample at some slice size (possible with few samples) averages over the sizes it drew,
  times the number of sizes, instead of counting that size as 0.

**Allocation (`cokv_counts`).** The reference (`set_cokv_size`): subtract the k-th smallest value, clip at 0,
and give each head int(value / sum x (base - window) x heads) tokens, plus a local window of 32 recent tokens
every head keeps. kvmem states the budget as the heads' total share (the keep ratio), and the scorer chooses the
tokens, so: every head first keeps `WINDOW` = 32 tokens (fewer when the shares are smaller: total // heads), and the
rest of the total is split in proportion to the clipped values. k = 1 (the smallest value is subtracted, so the
least valuable head keeps the window only); the reference sweeps k over 1..40 of 256 heads and fixes none. Two
departures keep the keep ratio exact: a head cannot keep more than it holds (the reference's index slice just
stops there, wasting that budget), so what a head cannot take is given to the others in proportion to their
values (water-filling); and the floors of the proportional split are topped up by largest remainder instead of
leaving the remainder unused. The heads compared are those `compress` is compressing (e.g. the global layers only
with `sliding=keep`). A whole-cache budget: it needs the model (`context=`), so `Compressor` refuses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.calibration import calibration_ids, load_or_fit

WINDOW = 32  # every head keeps this many tokens first (the reference's c*_w32 configs)
K_TH = 1  # the k-th smallest value is subtracted (set_cokv_size's k_th)
SLICES = (1, 2, 3, 4)  # coalition sizes n * k / 8
FIT = dict(sequences=1, context=192, continuation=32, samples=64, window=8, seed=0)


def cokv_values(lm, **params) -> dict[str, Tensor]:
    """{"layer.i": (KV heads,) Sliced Shapley value} for `lm`, fitted once per fingerprint and parameters (`FIT`,
    overridden by `params`) and cached; also "split_half_spearman" (1,): the estimator's split-half check."""
    params = {**FIT, **params}
    return load_or_fit(lm, "cokv", params, lambda: fit_values(lm, **params))


def slice_sizes(n: int) -> list[int]:
    """The coalition sizes of the slice for n players: n/8, 2n/8, 3n/8, 4n/8, rounded half up, at least 1."""
    return sorted({max(1, int(n * k / 8 + 0.5)) for k in SLICES})


@torch.no_grad()
def prefill_calibration(lm, sequences: int, context: int, continuation: int) -> tuple[list, list[list[int]]]:
    """The calibration sequences (`context` + `continuation` tokens of the shipped abstracts) and, for each, a cache
    holding its first `context` tokens: one prefill serves every coalition."""
    from kvmem.cache import KVCache
    from kvmem.forward import feed

    data = calibration_ids(lm.tokenizer, sequences, context + continuation)
    caches = []
    for ids in data:
        cache = KVCache(lm.model.config, observe_window=0)
        feed(lm, cache, ids[:context])
        caches.append(cache)
    return caches, data


@torch.no_grad()
def coalition_value(lm, caches: list, data: list[list[int]], keeps: list[list[bool]], window: int) -> float:
    """u(S): the mean log-likelihood of the continuations when head h of layer i keeps its whole cache if
    `keeps[i][h]`, else only its last `window` context tokens (on a copy of each prefilled cache). The first
    continuation token was predicted by the uncompressed prefill and is not counted."""
    total = 0.0
    for cache, ids in zip(caches, data):
        work = cache.clone()
        context = cache.get_seq_length()
        for layer, keep in zip(work.layers, keeps):
            layer.keep_only([torch.arange(n) if whole else torch.arange(max(0, n - window), n)
                             for whole, n in zip(keep, layer.lengths())])
        target = torch.tensor(ids[context:])
        logits = lm.model(input_ids=target[None, :-1], cache=work, use_cache=True, logits_to_keep=0).logits[0]
        total += float(logits.float().log_softmax(-1).gather(1, target[1:, None]).mean())
    return total / len(data)


def fit_values(lm, sequences: int, context: int, continuation: int, samples: int, window: int, seed: int
               ) -> dict[str, Tensor]:
    """Complementary-contribution estimate of every KV head's Sliced Shapley value (see the module's docstring)."""
    caches, data = prefill_calibration(lm, sequences, context, continuation)
    shape = [len(layer.lengths()) for layer in caches[0].layers]
    n = sum(shape)

    def value(members: Tensor) -> float:
        keeps, at = [], 0
        for k in shape:
            keeps.append(members[at:at + k].tolist())
            at += k
        return coalition_value(lm, caches, data, keeps, window)

    g = torch.Generator().manual_seed(seed)
    sizes = slice_sizes(n)
    credit = torch.zeros(2, len(sizes), n, dtype=torch.float64)  # [half (even/odd sample), size, head]
    count = torch.zeros_like(credit)
    for j, s in enumerate(sizes):
        for t in range(samples):
            members = torch.zeros(n, dtype=torch.bool)
            members[torch.randperm(n, generator=g)[:s]] = True
            cc = value(members) - value(~members)  # the complementary contribution of S
            credit[t % 2, j, members] += cc
            count[t % 2, j, members] += 1
    ssv = _sliced(credit.sum(0), count.sum(0))
    halves = [_sliced(credit[k], count[k]) for k in (0, 1)]
    out, at = {}, 0
    for i, k in enumerate(shape):  # players are numbered layer by layer, head by head
        out[f"layer.{i}"] = ssv[at:at + k].float()
        at += k
    out["split_half_spearman"] = torch.tensor([spearman(*halves)])
    return out


def _sliced(credit: Tensor, count: Tensor) -> Tensor:
    """(n,) the sum over slice sizes of each head's mean credit, over the sizes it drew, scaled to all sizes."""
    drawn = count > 0
    mean = torch.where(drawn, credit / count.clamp_min(1), torch.zeros_like(credit))
    return mean.sum(0) * credit.shape[0] / drawn.sum(0).clamp_min(1)


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation (no tie correction: the values are continuous)."""
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def cokv_counts(sizes: dict[int, list[int]], shares: dict[int, list[int]], values: dict[int, Tensor]
                ) -> dict[int, list[int]]:
    """Tokens each head keeps: {layer: [count per KV head]}. `sizes`: the compressible tokens each head holds;
    `shares`: each head's uniform share (their sum is the budget); `values`: each layer's heads' fitted values."""
    layers = sorted(sizes)
    heads = [(layer, h) for layer in layers for h in range(len(sizes[layer]))]
    size = torch.tensor([sizes[layer][h] for layer, h in heads], dtype=torch.long)
    total = min(sum(sum(shares[layer]) for layer in layers), int(size.sum()))
    value = torch.tensor([float(values[layer][h]) for layer, h in heads], dtype=torch.float64)
    border = value.sort().values[min(K_TH, value.numel()) - 1]
    weight = (value - border).clamp_min(0)  # set_cokv_size: max(CC - k-th smallest, 0)
    floor = torch.minimum(size, torch.full_like(size, max(1, min(WINDOW, total // max(len(heads), 1)))))
    counts = _water_fill(floor, size, weight, total - int(floor.sum()))
    out = {layer: [0] * len(sizes[layer]) for layer in layers}
    for (layer, h), c in zip(heads, counts.tolist()):
        out[layer][h] = c
    return out


def _water_fill(base: Tensor, cap: Tensor, weight: Tensor, rest: int) -> Tensor:
    """`base` plus `rest` tokens split in proportion to `weight`, no head above `cap`: what a capped head cannot
    take goes to the others in proportion; the floors are topped up by largest remainder."""
    counts = base.clone()
    while rest > 0:
        open_ = (counts < cap) & (weight > 0)
        if not open_.any():
            open_ = counts < cap  # every valued head is full: the rest goes evenly to the others
            if not open_.any():
                break
            w = open_.double()
        else:
            w = torch.where(open_, weight, torch.zeros_like(weight))
        exact = rest * w / w.sum()
        room = (cap - counts).double()
        if (exact > room).any():  # fill the heads that overflow, then split again what is left
            full = open_ & (exact >= room)
            rest -= int((cap - counts)[full].sum())
            counts[full] = cap[full]
            continue
        add = exact.floor().long()
        left = rest - int(add.sum())
        order = (exact - add.double()).masked_fill(~open_, -1.0).argsort(descending=True)
        add[order[:left]] += 1
        added = torch.minimum(counts + add, cap) - counts
        if int(added.sum()) == 0:
            break
        counts += added
        rest -= int(added.sum())
    return counts


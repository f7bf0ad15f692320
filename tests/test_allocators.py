"""The budget allocators of issue 35, each checked against its paper's procedure written out independently here, and
on the real models: not a sibling in disguise (other kept tokens than its neighbours on a fixed input), memory freed."""

from __future__ import annotations

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.compress import compress, get_method
from kvmem.compress.budget import allocate
from kvmem.errors import KVMemError
from kvmem.forward import feed


def reference_prefixkv(layer_scores: list[torch.Tensor], target_kept: int) -> list[int]:
    """PrefixKV's `obtain_cdf_num` (THU-MIG/PrefixKV, prefixkv.py), in kept rather than forgotten tokens: the layers'
    sorted, normalized cumulative score curves, one level searched until the kept total is within 5 tokens of the
    target, then every layer's count scaled to the exact total."""
    curves = torch.stack([s.sort(descending=True).values.div(s.sum()).cumsum(0) for s in layer_scores]).double()
    lo, hi, mid = 0.0, 1.0, 0.0
    while lo < hi:
        mid = (lo + hi) / 2
        kept = torch.searchsorted(curves, torch.full((len(layer_scores), 1), mid, dtype=torch.double)).squeeze(-1) + 1
        if abs(int(kept.sum()) - target_kept) < 5:
            break
        lo, hi = (mid, hi) if kept.sum() < target_kept else (lo, mid)
    kept = (torch.searchsorted(curves, torch.full((len(layer_scores), 1), mid, dtype=torch.double)).squeeze(-1) + 1).double()
    return (kept * target_kept / kept.sum()).tolist()


def test_prefixkv_follows_the_reference_search_and_keeps_the_total():
    g = torch.Generator().manual_seed(0)
    # layer 0: a few tokens hold the mass; layer 2: flat; layer 1 in between. Two heads each, holding the same tokens.
    base = [torch.rand(400, generator=g) ** p for p in (12.0, 3.0, 0.2)]
    scores = {layer: [base[layer] * (1 + 0.05 * h) for h in range(2)] for layer in range(3)}
    shares = {layer: [100, 100] for layer in range(3)}  # keep a quarter
    counts = allocate("prefixkv", scores, shares, range(3), aligned={layer: True for layer in range(3)})
    per_layer = [counts[layer][0] for layer in range(3)]
    assert all(len(set(c)) == 1 for c in counts.values())  # a layer's heads keep the same count
    assert sum(map(sum, counts.values())) == 600  # exactly the shares' total
    assert per_layer[0] < per_layer[1] < per_layer[2]  # peaked layers reach the common level with fewer tokens
    mean = [torch.stack(scores[layer]).mean(0) for layer in range(3)]  # the heads' mean per token, as the reference
    for ours, theirs in zip(per_layer, reference_prefixkv(mean, 300)):
        assert abs(ours - theirs) <= 2, (per_layer, theirs)
    # the retained share of each layer's mass is about the same level: that is the method
    reached = [float(m.sort(descending=True).values[:k].sum() / m.sum()) for m, k in zip(mean, per_layer)]
    assert max(reached) - min(reached) < 0.05, reached


def test_prefixkv_counts_always_kept_tokens_first_and_refuses_signed_scores():
    window = torch.cat([torch.rand(90), torch.full((10,), float("inf"))])  # a scorer's protected window
    counts = allocate("prefixkv", {0: [window], 1: [torch.rand(100)]}, {0: [30], 1: [30]}, range(2), aligned={0: True, 1: True})
    assert counts[0][0] >= 10 and sum(c[0] for c in counts.values()) == 60
    with pytest.raises(KVMemError, match="prefixkv.*non-negative"):
        allocate("prefixkv", {0: [torch.randn(50)]}, {0: [10]}, range(1), aligned={0: True})
    hidden = torch.cat([torch.rand(40), torch.full((10,), float("-inf"))])  # keys no query could see: no mass
    assert sum(allocate("prefixkv", {0: [hidden]}, {0: [20]}, range(1), aligned={0: True})[0]) == 20
    for signed in ("knorm", "keydiff", "q-filters"):  # refused when the spec is read, naming the scorer
        with pytest.raises(KVMemError, match=f"prefixkv.*{signed}'s scores are signed"):
            get_method(f"{signed}:budget=prefixkv")
    with pytest.raises(KVMemError, match="prefixkv.*kvcrush's scores are signed"):  # its scores are its base's
        get_method("kvcrush:base=knorm:budget=prefixkv")
    assert get_method("kvcrush:base=snapkv:budget=prefixkv").budget == "prefixkv"
    for base in ("moment-kv", "fastgen", "finch"):  # no share of a budget to give representatives
        with pytest.raises(KVMemError, match=f"kvcrush needs base=.*got base='{base}'"):
            get_method(f"kvcrush:base={base}")


def test_a_global_budget_refuses_signed_scores_which_do_not_compare_across_layers():
    for signed in ("knorm", "keydiff:kernel_size=33", "q-filters", "kvcrush:base=keydiff"):
        name = signed.split(":")[0]
        with pytest.raises(KVMemError, match=f"budget=global.*{name}'s scores .*not comparable across layers"):
            get_method(f"{signed}:budget=global")
    for mass in ("snapkv", "h2o", "kvzip", "random"):  # scores on one scale in every layer
        assert get_method(f"{mass}:budget=global").budget == "global"


def kept_positions(cache: KVCache, spec: str, ratio: float) -> list[list[list[int]]]:
    work = cache.clone()
    compress(work, get_method(spec), ratio)
    return [[positions.tolist() for _, _, positions in layer.rows.heads()] for layer in work.layers]


@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:400]
    cache = KVCache(smollm2.model.config, observe_window=32, track_attention=True)
    feed(smollm2, cache, ids)
    return cache


def test_prefixkv_is_not_a_sibling_in_disguise_and_frees_memory(smollm2, prefilled):
    ours = kept_positions(prefilled, "h2o:budget=prefixkv", 0.25)
    for sibling in ("h2o", "h2o:budget=pyramid", "h2o:budget=global", "h2o:budget=adaptive", "random"):
        assert ours != kept_positions(prefilled, sibling, 0.25), sibling
    counts = [len(layer[0]) for layer in ours]
    assert len(set(counts)) > 3  # layers keep different numbers of tokens
    work = prefilled.clone()
    result = compress(work, get_method("snapkv:budget=prefixkv"), 0.25)
    assert work.kv_bytes() == result.kv_bytes_after < prefilled.kv_bytes()
    assert 0.2 < result.fraction_kept < 0.3
    logits = feed(smollm2, work, smollm2.tokenizer(" The", add_special_tokens=False).input_ids)
    assert torch.isfinite(logits).all()


def test_prefixkv_on_gemma3_leaves_sliding_layers_whole_with_sliding_keep(gemma3):
    ids = gemma3.tokenizer("The quick brown fox jumps over the lazy dog. " * 40).input_ids
    cache = KVCache(gemma3.model.config, observe_window=32, track_attention=True)
    feed(gemma3, cache, ids)
    before = cache.tokens_held()
    compress(cache, get_method("snapkv:budget=prefixkv:sliding=keep"), 0.25)
    for layer, held, was in zip(cache.layers, cache.tokens_held(), before):
        assert (held == was) == bool(layer.is_sliding)


def test_pyramid_spans_the_layers_it_compresses_on_gemma3(gemma3):
    """PyramidKV's slope spans the layers a method compresses: with `sliding=keep` Gemma-3's 3 global layers keep the
    whole budget between them (the mean is the share), the lowest the most; after the prefill and layer by layer as
    the model runs alike. Spanning all 18 layers left them 72 % of it."""
    from kvmem.compress import Compressor

    ids = gemma3.tokenizer("The quick brown fox jumps over the lazy dog. " * 60).input_ids
    cache = KVCache(gemma3.model.config, observe_window=32)
    feed(gemma3, cache, ids)
    compress(cache, get_method("keydiff:budget=pyramid:sliding=keep"), 0.25)
    live = KVCache(gemma3.model.config, compressor=Compressor(get_method("keydiff:budget=pyramid:sliding=keep"), 0.25))
    feed(gemma3, live, ids)
    share = -(-len(ids) // 4)
    for held in (cache.tokens_held(), live.tokens_held()):
        counts = [held[i][0] for i, layer in enumerate(cache.layers) if not layer.is_sliding]
        assert len(counts) == 3 and counts == sorted(counts, reverse=True) and counts[0] > 10 * counts[-1]
        assert 3 * share - 2 <= sum(counts) <= 3 * share
    assert [layer.lengths() for layer in live.layers] == [layer.lengths() for layer in cache.layers]

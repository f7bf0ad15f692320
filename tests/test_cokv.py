"""budget=cokv (Sun et al. 2025): the allocation from fixed values follows the reference's `set_cokv_size`, written
out here independently; the coalition value is checked against transformers' eager model; the fitted values are cached
under the model fingerprint and refitted when it differs; on the real model it keeps other tokens than uniform,
adaptive and duo, holds exactly the budget, and frees memory; Compressor and a missing context are refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import Compressor, ModelContext, compress, cokv, get_method
from kvmem.compress.budget import allocate
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir

TINY = dict(sequences=1, context=24, continuation=6, samples=2, window=8, seed=0)  # a fit of seconds, for the tests


def reference_set_cokv_size(cc: torch.Tensor, base_capability: int, window_size: int, k_th: int) -> torch.Tensor:
    """nawei1010/CoKV `set_cokv_size`, line for line on a (layers, groups) table: subtract the k-th smallest, clip at
    0, and give each head int(its share of the sum x (base - window) x heads); the window is kept on top."""
    layers, groups = cc.shape
    base = base_capability - window_size
    flat = sorted(float(x) for row in cc for x in row)
    border = flat[k_th - 1]
    c = [[max(float(cc[i][j]) - border, 0) for j in range(groups)] for i in range(layers)]
    total = sum(sum(row) for row in c)
    return torch.tensor([[int(c[i][j] / total * base * layers * groups) for j in range(groups)] for i in range(layers)])


def test_allocation_follows_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(4, 3, generator=g, dtype=torch.float64)  # signed, as fitted values are
    sizes = {layer: [600] * 3 for layer in range(4)}  # room enough that no head is capped
    shares = {layer: [128] * 3 for layer in range(4)}  # the reference's base capacity 128, window 32
    counts = cokv.cokv_counts(sizes, shares, {layer: values[layer] for layer in range(4)})
    expected = reference_set_cokv_size(values, 128, 32, cokv.K_TH) + 32
    ours = torch.tensor([counts[layer] for layer in range(4)])
    assert ours.sum() == 12 * 128  # exactly the budget: the reference's int() leaves a few tokens, kvmem tops up
    assert ((ours - expected) >= 0).all() and ((ours - expected) <= 1).all()  # largest remainder adds at most one
    assert ours.flatten()[values.flatten().argmin()] == 32  # the least valuable head keeps the window only
    assert len(set(ours.flatten().tolist())) > 6  # not uniform


def test_allocation_caps_heads_at_what_they_hold_and_gives_the_rest_away():
    values = {0: torch.tensor([10.0, 1.0, 0.0]), 1: torch.tensor([5.0, 2.0, 3.0])}
    sizes, shares = {0: [100, 100, 100], 1: [100, 100, 100]}, {0: [60] * 3, 1: [60] * 3}
    counts = cokv.cokv_counts(sizes, shares, values)
    flat = counts[0] + counts[1]
    assert sum(flat) == 360 and max(flat) == 100  # the top head is capped; its excess went to the others
    assert flat[2] == 32  # the least valuable head: the window only
    assert flat[1] < flat[4] < flat[5] < flat[3]  # the others in the order of their values
    tiny = cokv.cokv_counts({0: [5, 5]}, {0: [1, 1]}, {0: torch.tensor([1.0, 0.0])})  # a few-token context
    assert tiny == {0: [1, 1]}  # every head keeps at least one token, and the total still holds
    assert allocate("cokv", {0: [torch.rand(5), torch.rand(5)]}, {0: [1, 1]}, range(1), {0: torch.tensor([1.0, 0.0])}) == tiny


def test_slice_is_the_references_eighths():
    assert cokv.slice_sizes(256) == [32, 64, 96, 128]  # the reference's SET_SIZES for Llama-3-8B's 256 groups
    assert cokv.slice_sizes(90) == [11, 23, 34, 45] and cokv.slice_sizes(18) == [2, 5, 7, 9]


def test_coalition_value_is_the_continuation_log_likelihood(smollm2):
    caches, data = cokv.prefill_calibration(smollm2, 1, 40, 8)
    every = [[True] * 3 for _ in range(30)]
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        logp = eager(input_ids=torch.tensor([data[0]])).logits[0].float().log_softmax(-1)
    target = torch.tensor(data[0][41:])
    expected = float(logp[40:47].gather(1, target[:, None]).mean())  # continuation tokens 2..8, not the first
    assert cokv.coalition_value(smollm2, caches, data, every, 8) == pytest.approx(expected, abs=2e-4)
    none = [[False] * 3 for _ in range(30)]
    half = [[h == 0 for h in range(3)] for _ in range(30)]
    u_none, u_half = (cokv.coalition_value(smollm2, caches, data, k, 8) for k in (none, half))
    assert u_none < u_half < expected  # each head's cache helps
    assert caches[0].tokens_held() == [[40] * 3] * 30  # coalitions are valued on copies


def test_fit_is_cached_under_the_fingerprint_and_refitted_when_it_differs(smollm2, tmp_path, monkeypatch):
    from kvmem import calibration

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    fits = []
    real = cokv.fit_values
    monkeypatch.setattr(cokv, "fit_values", lambda lm, **p: fits.append(lm.fingerprint) or real(lm, **p))
    first = cokv.cokv_values(smollm2, **TINY)
    assert len(fits) == 1 and sorted(first) == sorted([f"layer.{i}" for i in range(30)] + ["split_half_spearman"])
    assert all(first[f"layer.{i}"].shape == (3,) for i in range(30))
    calibration._LOADED.clear()
    again = cokv.cokv_values(smollm2, **TINY)  # from disk
    assert len(fits) == 1 and all(torch.equal(first[k], again[k]) for k in first)
    calibration._LOADED.clear()
    other = dataclasses.replace(smollm2, fingerprint=smollm2.fingerprint + "-other")  # same name, other weights
    cokv.cokv_values(other, **TINY)
    assert fits == [smollm2.fingerprint, other.fingerprint]  # the artefact of other weights is not used
    calibration._LOADED.clear()
    cokv.cokv_values(smollm2, **TINY)  # the overwritten file now holds the other fingerprint: refitted
    assert len(fits) == 3


@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:300]
    cache = KVCache(smollm2.model.config, observe_window=32, track_attention=True)
    feed(smollm2, cache, ids)
    return ids, cache


def kept(cache, spec: str, ratio: float, context) -> list[list[list[int]]]:
    work = cache.clone()
    compress(work, get_method(spec), ratio, context=context)
    return [[p.tolist() for p in layer.head_positions] for layer in work.layers]


def test_not_a_sibling_in_disguise_and_frees_memory(smollm2, prefilled):
    """With the model's fitted values (the default fit, once per machine; cached like the retrieval probes)."""
    ids, cache = prefilled
    context = ModelContext(smollm2, ids)
    ours = kept(cache, "snapkv:budget=cokv", 0.3, context)
    for sibling in ("snapkv", "snapkv:budget=adaptive", "snapkv:budget=duo"):
        assert ours != kept(cache, sibling, 0.3, context), sibling
    counts = [len(p) for layer in ours for p in layer]
    assert sum(counts) == 90 * math.ceil(0.3 * 300) and len(set(counts)) > 10
    values = cokv.cokv_values(smollm2)
    expected = cokv.cokv_counts({i: [300] * 3 for i in range(30)}, {i: [90] * 3 for i in range(30)},
                                {i: values[f"layer.{i}"] for i in range(30)})
    assert counts == [c for i in range(30) for c in expected[i]]  # the fitted values size the heads
    work = cache.clone()
    result = compress(work, get_method("h2o:budget=cokv"), 0.3, context=context)
    assert work.kv_bytes() == result.kv_bytes_after < 0.35 * cache.kv_bytes()
    assert torch.isfinite(feed(smollm2, work, smollm2.tokenizer(" The", add_special_tokens=False).input_ids)).all()


def test_only_the_compressed_layers_are_compared_on_gemma3(gemma3, monkeypatch):
    values = {f"layer.{i}": torch.tensor([float(i)]) for i in range(18)}  # fixed values: no fit needed here
    import importlib

    monkeypatch.setattr(importlib.import_module("kvmem.compress.evict"), "cokv_values", lambda lm: values)
    ids = gemma3.tokenizer("The quick brown fox jumps over the lazy dog. " * 30).input_ids
    cache = KVCache(gemma3.model.config, observe_window=32)
    feed(gemma3, cache, ids)
    before = cache.tokens_held()
    work = cache.clone()
    compress(work, get_method("snapkv:budget=cokv:sliding=keep"), 0.5, context=ModelContext(gemma3, ids))
    held = work.tokens_held()
    compressed = [i for i, layer in enumerate(work.layers) if not layer.is_sliding]
    assert all(held[i] == before[i] for i, layer in enumerate(work.layers) if layer.is_sliding)
    counts = [held[i][0] for i in compressed]
    assert sum(counts) == len(compressed) * math.ceil(0.5 * len(ids)) and counts == sorted(counts)  # by value
    assert counts[0] == 32  # the least valuable compressed layer keeps the window only


def test_layer_by_layer_and_missing_model_are_refused_by_name(prefilled):
    with pytest.raises(KVMemError, match="budget 'cokv'"):
        Compressor(get_method("snapkv:budget=cokv"), 0.5)
    with pytest.raises(KVMemError, match="budget 'cokv' needs the model"):
        compress(prefilled[1].clone(), get_method("snapkv:budget=cokv"), 0.5)
    with pytest.raises(KVMemError, match="unknown budget 'cokv2'"):
        get_method("snapkv:budget=cokv2")

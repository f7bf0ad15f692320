"""Each method scores what its paper says, checked against attention weights that transformers' own
eager attention computes on the real SmolLM2 (an independent path from kvmem's), and each method's
selection rule. A method quietly turning into another one fails here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import METHODS, compress, get_method
from kvmem.compress.base import head_views
from kvmem.generate import feed
from kvmem.models import cache_dir

N_CTX = 150
GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
LAYERS = (0, 7, 29)


@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    cache = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, cache, ids)
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return cache, [a[0] for a in attentions]  # per layer (query heads, T, T)


def group(attn, h):
    return attn[h * GROUPS:(h + 1) * GROUPS]


def test_h2o_scores_are_accumulated_attention(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            expected = group(attn[layer], view.head).sum(dim=1).mean(dim=0)  # column sums over all queries
            torch.testing.assert_close(get_method("h2o").score(view), expected, atol=2e-4, rtol=1e-3)


def test_snapkv_scores_are_pooled_window_votes(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            votes = group(attn[layer], view.head)[:, -32:, :].sum(dim=1).mean(dim=0)[:-32]
            expected = F.max_pool1d(votes[None, None], 7, stride=1, padding=3)[0, 0]
            score = get_method("snapkv").score(view)
            torch.testing.assert_close(score[:-32], expected, atol=2e-4, rtol=1e-3)
            assert torch.isinf(score[-32:]).all()  # the observation window is always kept


def test_tova_scores_are_last_token_attention_averaged_over_the_layers_heads(prefilled):
    cache, attn = prefilled
    for layer in LAYERS:
        scores = get_method("tova").score_layer(head_views(cache.layers[layer], layer))
        expected = attn[layer][:, -1, :].mean(dim=0)
        for s in scores:
            torch.testing.assert_close(s, expected, atol=2e-5, rtol=1e-3)


def test_knorm_keeps_the_lowest_key_norms(prefilled):
    cache = prefilled[0].clone()
    norms = [[k.norm(dim=-1) for k in layer.head_keys] for layer in cache.layers]
    positions = [[p.clone() for p in layer.head_positions] for layer in cache.layers]
    compress(cache, get_method("knorm"), 0.3)
    for li, layer in enumerate(cache.layers):
        for h, kept in enumerate(layer.head_positions):
            is_kept = torch.isin(positions[li][h], kept)
            assert norms[li][h][is_kept].max() <= norms[li][h][~is_kept].min()


def test_streaming_llm_keeps_sinks_and_recent(prefilled):
    cache = prefilled[0].clone()
    compress(cache, get_method("streaming-llm"), 0.2)
    n_keep = math.ceil(0.2 * N_CTX)
    expected = list(range(4)) + list(range(N_CTX - (n_keep - 4), N_CTX))
    for layer in cache.layers:
        for p in layer.head_positions:
            assert p.tolist() == expected


def test_h2o_keeps_recent_half_plus_heavy_hitters(prefilled):
    cache = prefilled[0].clone()
    heavy_scores = [get_method("h2o").score(v) for v in head_views(cache.layers[7], 7)]
    compress(cache, get_method("h2o"), 0.2)
    n_keep = math.ceil(0.2 * N_CTX)
    n_recent = n_keep // 2
    for h, kept in enumerate(cache.layers[7].head_positions):
        assert kept[-n_recent:].tolist() == list(range(N_CTX - n_recent, N_CTX))
        older = heavy_scores[h][: N_CTX - n_recent]
        assert sorted(kept[:-n_recent].tolist()) == sorted(older.topk(n_keep - n_recent).indices.tolist())


def test_random_is_seeded_and_not_another_method(prefilled):
    a, b = prefilled[0].clone(), prefilled[0].clone()
    compress(a, get_method("random"), 0.3)
    compress(b, get_method("random"), 0.3)
    s = prefilled[0].clone()
    compress(s, get_method("streaming-llm"), 0.3)
    assert a.layers[3].head_positions[0].tolist() == b.layers[3].head_positions[0].tolist()
    assert a.layers[3].head_positions[0].tolist() != s.layers[3].head_positions[0].tolist()
    assert a.layers[3].head_positions[0].tolist() != a.layers[3].head_positions[1].tolist()


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_every_method_frees_memory_and_still_generates(name, request):
    lm = request.getfixturevalue(name)
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 25).input_ids
    base = KVCache(lm.model.config, observe_window=64, track_attention=True)
    feed(lm, base, ids)
    for method in METHODS:
        if method == "full":
            continue
        cache = base.clone()
        result = compress(cache, get_method(method), 0.5)
        assert 0.45 < result.fraction_kept < 0.56, method
        assert cache.kv_bytes() == result.kv_bytes_after < base.kv_bytes()
        logits = feed(lm, cache, lm.tokenizer(" The quick", add_special_tokens=False).input_ids)
        assert torch.isfinite(logits).all()

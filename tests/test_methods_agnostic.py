"""Keyformer and DapQ score what their papers say, checked against attention that transformers' own eager
attention computes on the real SmolLM2 (an independent path from kvmem's replay), and keep other tokens than
their nearest siblings and `random`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import ModelContext, compress, get_method
from kvmem.compress.evict import head_views
from kvmem.compress.keyformer import BLOCK, gumbel
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir

N_CTX = 150
GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
LAYERS = (0, 7, 29)


@pytest.fixture(scope="module")
def eager():
    return AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")


@pytest.fixture(scope="module")
def ids(smollm2):
    return smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]


@pytest.fixture(scope="module")
def prefilled(smollm2, eager, ids):
    cache = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, cache, ids)
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return cache, [a[0] for a in attentions]  # per layer (query heads, T, T)


def group(attn, h):
    return attn[h * GROUPS:(h + 1) * GROUPS]


def kept_positions(cache, spec: str, ratio: float, context=None) -> list[list[list[int]]]:
    c = cache.clone()
    compress(c, get_method(spec), ratio, context=context)
    return [[p.tolist() for p in layer.head_positions] for layer in c.layers]


# -- keyformer ---------------------------------------------------------------------------------------------------------


def test_keyformer_noise_is_standard_gumbel_and_seeded():
    z = gumbel(0, 1, 2, 0, (200_000,))
    assert z.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni: location 0
    assert z.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.01)  # scale 1
    assert torch.equal(z, gumbel(0, 1, 2, 0, (200_000,))) and not torch.equal(z, gumbel(1, 1, 2, 0, (200_000,)))


def test_keyformer_scores_are_gumbel_softmax_accumulated_over_the_prompt(smollm2, prefilled, ids):
    """softmax((x + z) / tau) summed over every prompt query, x the eager model's logits (its log-attention: the same
    up to a per-row constant the softmax drops), z the seeded noise, averaged over the query group."""
    cache, attn = prefilled
    method = get_method("keyformer:tau=1.5:seed=3")
    views = {layer: head_views(cache.layers[layer], layer) for layer in LAYERS}
    scores = method.score_cache(views, cache, ModelContext(smollm2, ids))
    for layer in LAYERS:
        for view, score in zip(views[layer], scores[layer]):
            log_attn = group(attn[layer], view.head).log()
            expected = torch.zeros(N_CTX)
            for s in range(0, N_CTX, BLOCK):
                e = min(s + BLOCK, N_CTX)
                z = gumbel(3, layer, view.head, s, (GROUPS, e - s, e))
                expected[:e] += ((log_attn[:, s:e, :e] + z) / 1.5).softmax(-1).sum(1).mean(0)
            torch.testing.assert_close(score, expected, atol=5e-4, rtol=1e-3)
            assert not torch.allclose(score, group(attn[layer], view.head).sum(1).mean(0), atol=1e-2)  # not H2O's


def test_keyformer_keeps_the_recent_30_percent_and_the_top_scores_before_them(smollm2, prefilled, ids):
    cache, _ = prefilled
    context = ModelContext(smollm2, ids)
    method = get_method("keyformer")
    scores = method.score_cache({7: head_views(cache.layers[7], 7)}, cache, context)[7]
    c = cache.clone()
    result = compress(c, method, 0.2, context=context)
    n_keep = math.ceil(0.2 * N_CTX)
    n_recent = int(n_keep * 0.3)
    for h, kept in enumerate(c.layers[7].head_positions):
        assert sorted(kept.tolist())[-n_recent:] == list(range(N_CTX - n_recent, N_CTX))
        older = scores[h][:N_CTX - n_recent]
        assert sorted(kept.tolist())[:-n_recent] == sorted(older.topk(n_keep - n_recent).indices.tolist())
    assert c.kv_bytes() == result.kv_bytes_after < result.kv_bytes_before
    assert result.fraction_kept == pytest.approx(n_keep / N_CTX, abs=0.01)  # memory is freed, not masked


def test_keyformer_is_not_h2o_or_random_and_its_seed_decides(smollm2, prefilled, ids):
    cache, _ = prefilled
    kept = kept_positions(cache, "keyformer", 0.3, ModelContext(smollm2, ids))
    assert kept == kept_positions(cache, "keyformer:seed=0", 0.3, ModelContext(smollm2, ids))  # a fresh replay
    assert kept != kept_positions(cache, "keyformer:seed=1", 0.3, ModelContext(smollm2, ids))
    assert kept != kept_positions(cache, "h2o", 0.3) and kept != kept_positions(cache, "h2o:recent_fraction=0.3", 0.3)
    assert kept != kept_positions(cache, "random", 0.3)


# -- dapq --------------------------------------------------------------------------------------------------------------


def test_dapq_scores_are_pooled_attention_of_pseudo_queries_after_the_prompt(smollm2, prefilled, eager, ids):
    """The eager model runs prompt + pseudo tokens (the prompt's first 4 and last 28) at positions N_CTX..N_CTX+31:
    the pseudo rows' attention on the prompt, summed and max-pooled, is the score."""
    cache, _ = prefilled
    with torch.no_grad():
        attn = eager(input_ids=torch.tensor([ids + ids[:4] + ids[-28:]]), output_attentions=True).attentions
    views = {layer: head_views(cache.layers[layer], layer) for layer in LAYERS}
    context = ModelContext(smollm2, ids)
    pooled = get_method("dapq").score_cache(views, cache, context)
    raw = get_method("dapq:kernel_size=1").score_cache(views, cache, context)
    for layer in LAYERS:
        for view, score, votes in zip(views[layer], pooled[layer], raw[layer]):
            expected = group(attn[layer][0], view.head)[:, N_CTX:, :N_CTX].sum(1).mean(0)
            torch.testing.assert_close(votes, expected, atol=2e-5, rtol=1e-3)
            torch.testing.assert_close(score, F.max_pool1d(expected[None, None], 7, stride=1, padding=3)[0, 0],
                                       atol=2e-5, rtol=1e-3)


def test_dapq_pseudo_content_and_length_are_options(smollm2, prefilled, eager, ids):
    cache, _ = prefilled
    with torch.no_grad():
        attn = eager(input_ids=torch.tensor([ids + ids[:2] + ids[-14:]]), output_attentions=True).attentions
    view = head_views(cache.layers[7], 7)[1]
    score = get_method("dapq:window=16:prefix=2:kernel_size=1").score_cache({7: [view]}, cache, ModelContext(smollm2, ids))
    torch.testing.assert_close(score[7][0], group(attn[7][0], 1)[:, N_CTX:, :N_CTX].sum(1).mean(0), atol=2e-5, rtol=1e-3)


def test_dapq_is_not_snapkv_expected_attention_or_random_and_frees_memory(smollm2, prefilled, ids):
    cache, _ = prefilled
    context = ModelContext(smollm2, ids)
    dapq = kept_positions(cache, "dapq", 0.3, context)
    assert dapq != kept_positions(cache, "snapkv", 0.3) and dapq != kept_positions(cache, "random", 0.3)
    assert dapq != kept_positions(cache, "expected-attention", 0.3, context)
    c = cache.clone()
    result = compress(c, get_method("dapq"), 0.3, context=context)
    assert c.kv_bytes() == result.kv_bytes_after < result.kv_bytes_before
    assert result.fraction_kept == pytest.approx(math.ceil(0.3 * N_CTX) / N_CTX, abs=0.01)
    assert sum(map(sum, c.tokens_held())) == 90 * math.ceil(0.3 * N_CTX)  # the pseudo tokens are gone too


@pytest.mark.parametrize("spec, option", [
    ("keyformer:tau=0", "tau"), ("keyformer:recent_fraction=1", "recent_fraction"), ("keyformer:seed=1.5", "seed"),
    ("keyformer:tau_end=2", "tau_end"), ("dapq:window=0", "window"), ("dapq:prefix=40", "prefix"),
    ("dapq:kernel_size=4", "kernel_size"), ("dapq:seed=1", "seed"),
])
def test_a_bad_option_is_refused_by_name(spec, option):
    with pytest.raises(KVMemError, match=option):
        get_method(spec)

"""token-prepending and kv-embedding: their edits of the forward pass, checked against manual computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvmem.embed import get_embedder
from kvmem.embed import kv_embedding
from kvmem.embed.kv_embedding import ReRoute, two_nn_dimension
from kvmem.errors import KVMemError

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, and a very large and old city on the Seine."]


def test_two_nn_recovers_the_dimension_of_a_linear_subspace():
    rng = np.random.default_rng(0)
    for d in (2, 5, 10):
        points = rng.normal(size=(1500, d)) @ rng.normal(size=(d, 64))  # a d-dim subspace of R^64
        assert abs(two_nn_dimension(points) - d) < 0.2 * d, d
    assert np.isnan(two_nn_dimension(np.ones((50, 8))))  # all points equal: no nearest-neighbour ratio


def test_reroute_equals_a_manual_attention_with_the_prefix(tiny_llama):
    """Re-routing layer 0 of a tiny Llama: every token attends to the final token's K/V put at position 0."""
    body = tiny_llama.model
    ids = torch.tensor([[5, 17, 3, 99, 42, 7]])
    T, attn = ids.shape[1], body.layers[0].self_attn
    reroute = ReRoute(frozenset({0}), bias=0.7, last=torch.tensor([T - 1]), lengths=torch.tensor([T]))
    handle = attn.register_forward_pre_hook(lambda m, a, kw: reroute.rope.__setitem__(0, kw["position_embeddings"]),
                                            with_kwargs=True)
    positions = torch.arange(1, T + 1)[None]
    with torch.no_grad():
        got = body(input_ids=ids, position_ids=positions, output_hidden_states=True, use_cache=False,
                   kvmem_reroute=reroute).hidden_states[1]
        handle.remove()
        x = body.embed_tokens(ids)
        h = body.layers[0].input_layernorm(x)
        shape = (1, T, -1, attn.head_dim)
        q, k, v = (p(h).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        k_prefix, v_prefix = k[:, :, -1:], v[:, :, -1:]  # position 0: RoPE is the identity
        cos, sin = body.rotary_emb(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys = torch.cat((k_prefix, k), 2).repeat_interleave(2, 1)
        values = torch.cat((v_prefix, v), 2).repeat_interleave(2, 1)
        logits = q @ keys.transpose(-1, -2) * attn.scaling
        logits[..., 0] += 0.7
        logits[..., 1:] += torch.full((T, T), float("-inf")).triu(1)
        out = (logits.softmax(-1) @ values).transpose(1, 2).reshape(1, T, -1)
        x = x + attn.o_proj(out)
        want = x + body.layers[0].mlp(body.layers[0].post_attention_layernorm(x))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kv_embedding_reroutes_only_where_asked(smollm2):
    plain = get_embedder("kv-embedding", smollm2, layers=[]).encode(TEXTS)
    muted = get_embedder("kv-embedding", smollm2, layers=[3, 4], bias=-1e4).encode(TEXTS)  # prefix never attended
    np.testing.assert_allclose(muted, plain, atol=1e-5)
    on = get_embedder("kv-embedding", smollm2, layers=[3, 4]).encode(TEXTS)
    stronger = get_embedder("kv-embedding", smollm2, layers=[3, 4], bias=2.0).encode(TEXTS)
    assert not np.allclose(on, plain, atol=1e-3) and not np.allclose(on, stronger, atol=1e-3)
    again = get_embedder("kv-embedding", smollm2, layers=[3, 4])  # a second instance: same result
    np.testing.assert_array_equal(again.encode(TEXTS), on)
    with pytest.raises(KVMemError, match="re-routing layers"):
        get_embedder("kv-embedding", smollm2, layers=[30])


def test_kv_embedding_on_gemma_sliding_layers_is_batch_independent(gemma3):
    emb = get_embedder("kv-embedding", gemma3, layers=[4, 5, 6])  # layer 5 is global, 4 and 6 sliding
    batch = emb.encode(TEXTS, batch_size=2)
    alone = np.stack([emb.encode(t) for t in TEXTS])
    np.testing.assert_allclose(batch, alone, atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1) > 0, True)


def test_id_rule_picks_the_minimum_after_the_early_peak(smollm2, monkeypatch):
    emb = get_embedder("kv-embedding", smollm2, layers=[])
    monkeypatch.setattr(kv_embedding, "ID_CALIBRATION", 24)
    ids = emb.intrinsic_dimensions()
    assert len(ids) == 31 and np.isnan(ids[0]) and np.isfinite(ids[1:]).all() and min(ids[1:]) > 1
    profile = [np.nan, 10, 14, 20, 18, 9, 16, 12, 11] + [15] * 21 + [3.0]  # last layer excluded
    monkeypatch.setitem(kv_embedding._ID_MEMO, smollm2.model, profile)
    assert get_embedder("kv-embedding", smollm2).reroute_layers == [2, 3, 4, 5, 6, 7, 8]  # m = 5, w = 3


def test_token_prepending_edits_only_its_layers(smollm2):
    prompteol = get_embedder("prompteol", smollm2).encode(TEXTS)
    tp = get_embedder("token-prepending", smollm2)
    assert (tp.start, tp.exit) == (1, 6)
    out = tp.encode(TEXTS)
    assert not np.allclose(out, prompteol, atol=1e-2)
    # the placeholder only matters through the layers that overwrite it: with start = exit - 1 = 0 the random
    # row is overwritten before layer 0, so a different seed changes nothing
    a = get_embedder("token-prepending", smollm2, start=0, exit=1, seed=0).encode(TEXTS)
    b = get_embedder("token-prepending", smollm2, start=0, exit=1, seed=1).encode(TEXTS)
    np.testing.assert_allclose(a, b, atol=1e-5)
    c = get_embedder("token-prepending", smollm2, start=1, exit=2, seed=1).encode(TEXTS)
    assert not np.allclose(a, c, atol=1e-3)
    with pytest.raises(KVMemError, match="start < exit"):
        get_embedder("token-prepending", smollm2, start=4, exit=2)


@pytest.mark.parametrize("spec", ["mean", "last", "prompteol", "echo", "token-prepending", "kv-embedding:layers=11-13"])
def test_every_llm_method_on_gemma(gemma3, spec):
    emb = get_embedder(spec, gemma3)
    batch = emb.encode(TEXTS, batch_size=2, normalize_embeddings=True)
    assert batch.shape == (2, 640) and np.isfinite(batch).all()
    np.testing.assert_allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    alone = emb.encode(TEXTS[1], normalize_embeddings=True)  # no padding: the batch changes nothing
    np.testing.assert_allclose(batch[1], alone, atol=1e-4)
    assert not np.allclose(batch[0], batch[1], atol=1e-2)


def test_too_long_text_is_a_clear_error(smollm2):
    with pytest.raises(KVMemError, match="text too long to embed"):
        get_embedder("mean", smollm2).encode("word " * 9000)


@pytest.mark.parametrize("spec,problem", [
    ("kv-embedding:bias=abc", "must be a number"), ("token-prepending:start=1.5", "must be an integer"),
    ("token-prepending:exit=abc", "exit must be a layer number"), ("kv-embedding:layers=9-3", "empty range"),
    ("kv-embedding:layers=abc", "'id', 'all', 'none'"), ("kv-embedding:template=plain", "exactly once"),
    ("prompteol:template={text} {x}", "braces other than"),
])
def test_bad_options_are_named_errors(smollm2, spec, problem):
    with pytest.raises(KVMemError, match=problem):
        get_embedder(spec, smollm2)

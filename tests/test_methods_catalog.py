"""The catalog's newer scorers (issue 35), checked as tests/test_methods.py checks the others: each scores what its
paper says, computed here on an independent path (transformers' own eager attention, or raw logits rebuilt from the
model's projections and rotary embedding), keeps other tokens than its nearest sibling and than `random`, frees
memory, and refuses a bad option by name."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvmem.cache import KVCache
from kvmem.compress import Compressor, compress, get_method
from kvmem.compress.evict import head_views
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir

N_CTX = 150
GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
HEAD_DIM = 64
LAYERS = (0, 7, 29)


@pytest.fixture(scope="module")
def prefilled(smollm2):
    """kvmem's cache after a prefill, and what transformers' eager model computes on the same ids: attention
    weights, and per layer the q/k/v projections (before RoPE) captured by hooks."""
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    cache = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, cache, ids)
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    proj, hooks = {}, []
    for i in LAYERS:
        attn = eager.model.layers[i].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(attn, name).register_forward_hook(
                lambda m, inp, out, key=(i, name): proj.__setitem__(key, out[0].detach())))
    with torch.no_grad():
        out = eager(input_ids=torch.tensor([ids]), output_attentions=True)
        cos, sin = eager.model.rotary_emb(proj[(0, "q_proj")][None], torch.arange(N_CTX)[None])
    for h in hooks:
        h.remove()
    return cache, [a[0] for a in out.attentions], proj, (cos, sin)


def group(attn, h):
    return attn[h * GROUPS:(h + 1) * GROUPS]


def kept_positions(cache, spec: str, ratio: float) -> list[list[list[int]]]:
    c = cache.clone()
    compress(c, get_method(spec), ratio)
    return [[p.tolist() for p in layer.head_positions] for layer in c.layers]


def value_l1(proj, layer: int, h: int):
    return proj[(layer, "v_proj")].view(N_CTX, -1, HEAD_DIM)[:, h].abs().sum(dim=-1)


def test_vatp_scores_are_accumulated_attention_times_value_l1_norm(prefilled):
    cache, attn, proj, _ = prefilled
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            expected = group(attn[layer], view.head).sum(dim=1).mean(dim=0) * value_l1(proj, layer, view.head)
            score = get_method("vatp").score(view)
            assert torch.isinf(score[:20]).all()  # the reference's 20 sink tokens
            torch.testing.assert_close(score[20:], expected[20:], atol=2e-4, rtol=1e-3)


def test_vatp_window_source_is_mean_window_attention_times_value_l1_norm(prefilled):
    cache, attn, proj, _ = prefilled
    method = get_method("vatp:source=window:window=64")
    assert not method.needs_attention and method.observe_window == 64
    for view in head_views(cache.layers[7], 7):
        expected = group(attn[7], view.head)[:, -64:].mean(dim=1).mean(dim=0) * value_l1(proj, 7, view.head)
        score = method.score(view)
        torch.testing.assert_close(score[20:], expected[20:], atol=2e-5, rtol=1e-3)
    n_keep = math.ceil(0.3 * N_CTX)
    for p in kept_positions(cache, "vatp:source=window:window=64", 0.3)[7]:
        assert p[:20] == list(range(20)) and p[-10:] == list(range(N_CTX - 10, N_CTX)) and len(p) == n_keep


def test_vatp_keeps_h2o_split_and_is_not_h2o_or_random(prefilled):
    cache = prefilled[0]
    scores = [get_method("vatp").score(v) for v in head_views(cache.layers[7], 7)]
    vatp = kept_positions(cache, "vatp", 0.3)
    n_keep = math.ceil(0.3 * N_CTX)
    n_recent = n_keep // 2
    for h, kept in enumerate(vatp[7]):
        kept = torch.tensor(kept)
        assert kept[-n_recent:].tolist() == list(range(N_CTX - n_recent, N_CTX))
        older = scores[h][: N_CTX - n_recent]
        assert sorted(kept[:-n_recent].tolist()) == sorted(older.topk(n_keep - n_recent).indices.tolist())
    assert vatp != kept_positions(cache, "h2o", 0.3) and vatp != kept_positions(cache, "random", 0.3)
    assert vatp != kept_positions(cache, "vatp:n_sink=0", 0.3)  # sinks are protected, not just high-scoring
    assert kept_positions(cache, "vatp:source=window:window=64", 0.3) != kept_positions(cache, "snapkv:window=64", 0.3)


def raw_logits(proj, rope, layer: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """<q_j, k_i> of the query heads of KV head `h`, from the eager model's projections and rotary embedding:
    (group, T queries, T keys), no scaling, no mask."""
    q = proj[(layer, "q_proj")].view(N_CTX, -1, HEAD_DIM).transpose(0, 1)[h * GROUPS:(h + 1) * GROUPS]
    k = proj[(layer, "k_proj")].view(N_CTX, -1, HEAD_DIM).transpose(0, 1)[h:h + 1]
    q, k = apply_rotary_pos_emb(q[None], k[None], *rope)
    return q[0] @ k[0, 0].T


def antitone_bound(x: torch.Tensor, y: torch.Tensor) -> float:
    """max over couplings of E[(X - Y)^+], computed from quantiles: X's largest paired with Y's smallest."""
    n = math.lcm(x.numel(), y.numel())
    xs = x.sort().values.repeat_interleave(n // x.numel())
    ys = y.sort(descending=True).values.repeat_interleave(n // y.numel())
    return float((xs - ys).clamp(min=0).mean())


def test_rcstat_scores_are_the_rc_upper_bound_from_raw_logits(prefilled):
    cache, _, proj, rope = prefilled
    w, method = 32, get_method("rcstat")
    window = torch.arange(N_CTX - w, N_CTX)
    causal = window[:, None] >= window[None, :]  # query j sees window key i <= j
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            logits = raw_logits(proj, rope, layer, view.head)[:, -w:]  # the window's queries
            expected = torch.tensor([
                sum(antitone_bound(lg[:, i], lg[:, -w:][causal]) for lg in logits) / GROUPS
                for i in range(N_CTX - w)])
            score = method.score(view)
            assert torch.isinf(score[-w:]).all()  # the window is kept
            torch.testing.assert_close(score[:-w], expected, atol=2e-3, rtol=2e-3)


def test_rc_bound_is_the_integral_of_min_of_the_marginals_with_unseen_logits():
    """The bound as its definition reads, integral of min(F_Y(t), P(X_i > t)) dt on the merged breakpoints, on random
    logits where a sliding window hides some keys from some queries (those logits are no samples of X_i)."""
    from kvmem.compress.rcstat import rc_bound

    torch.manual_seed(0)
    cross, y = torch.randn(8, 30) * 3, torch.randn(36) * 2 + 1
    seen = torch.ones(8, 30, dtype=torch.bool)
    seen[:5, :3] = False  # keys 0-2 are seen by the last 3 queries only
    seen[:, 3] = False  # key 3 by none
    got = rc_bound(cross, seen, y)
    assert got[3] == float("-inf")
    for i in (0, 1, 2, 4, 17):
        x = cross[seen[:, i], i]
        grid = torch.cat([x, y]).sort().values
        f_y = (y[None] <= grid[:-1, None]).float().mean(dim=1)
        s_x = (x[None] > grid[:-1, None]).float().mean(dim=1)
        expected = ((grid[1:] - grid[:-1]) * torch.minimum(f_y, s_x)).sum()
        torch.testing.assert_close(got[i], expected, atol=1e-5, rtol=1e-5)
        assert abs(antitone_bound(x, y) - float(expected)) < 1e-4  # the coupling that reaches it


def test_rcstat_is_not_snapkv_or_random_and_shares_a_layers_budget(prefilled):
    cache = prefilled[0]
    rcstat = kept_positions(cache, "rcstat", 0.3)
    assert rcstat != kept_positions(cache, "snapkv", 0.3) and rcstat != kept_positions(cache, "random", 0.3)
    assert rcstat != kept_positions(cache, "snapkv:budget=adaptive", 0.3)  # not snapkv's votes, same allocator
    uniform = kept_positions(cache, "rcstat:budget=uniform", 0.3)
    assert all(len(p) == math.ceil(0.3 * N_CTX) for layer in uniform for p in layer)
    sizes = [[len(p) for p in layer] for layer in rcstat]
    assert any(len(set(s)) > 1 for s in sizes)  # heads of a layer keep what their RC earns
    assert all(sum(s) == 3 * math.ceil(0.3 * N_CTX) for s in sizes)  # the layer's total is the keep ratio's


@pytest.mark.parametrize("spec", ["vatp", "vatp:source=window:window=64", "rcstat", "rcstat:budget=uniform"])
def test_catalog_methods_free_memory(prefilled, spec):
    cache = prefilled[0].clone()
    before = cache.kv_bytes()
    result = compress(cache, get_method(spec), 0.3)
    assert cache.kv_bytes() == result.kv_bytes_after < before
    assert result.fraction_kept == pytest.approx(math.ceil(0.3 * N_CTX) / N_CTX, abs=0.01)


@pytest.mark.parametrize("spec", ["vatp", "vatp:source=window:window=64", "rcstat"])
def test_catalog_methods_compress_inside_model_generate(smollm2, spec):
    """Through `model.generate` with a Compressor: the same tokens and output as prefilling, compressing the whole
    cache, then decoding."""
    from kvmem.generate import decode

    lm = smollm2
    ids = lm.tokenizer("Alice has 3 cats. Bob has 5 dogs. " * 20 + "How many dogs does Bob have? Bob has").input_ids
    cache = KVCache(lm.model.config, compressor=Compressor(get_method(spec), 0.3))
    out = lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    manual = KVCache(lm.model.config, observe_window=64, track_attention=get_method(spec).needs_attention)
    logits = feed(lm, manual, ids)
    compress(manual, get_method(spec), 0.3)
    assert decode(lm, manual, logits, 5, stop_at_newline=False) == out
    assert cache.tokens_held() == manual.tokens_held() and cache.kv_bytes() == manual.kv_bytes()


@pytest.mark.parametrize("spec, option", [("vatp:source=softmax", "source"), ("vatp:n_sink=-1", "n_sink"),
                                          ("vatp:window=0", "window"), ("vatp:sinks=4", "sinks"),
                                          ("rcstat:window=1", "window"), ("rcstat:threshold=0.5", "threshold")])
def test_catalog_methods_refuse_a_bad_option_by_name(spec, option):
    with pytest.raises(KVMemError, match=option):
        get_method(spec)

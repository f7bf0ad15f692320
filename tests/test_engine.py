"""Engine invariants on tiny random models (fast, so hypothesis can try many cases).

The central property: evicting tokens from a KVCache gives the same next-token logits as the
uncompressed model with those tokens masked out (same original positions) - per KV head, with
sliding-window layers, for any keep ratio and budget.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvmem.cache import KVCache, storage_bytes
from kvmem.rows import GROW
from kvmem.compress import HeadView, Method, compress, get_method
from kvmem.errors import KVMemError


class FixedScores(Method):
    """Scores that depend only on (KV head, position): every layer evicts the same tokens per head,
    so one 4-D mask describes the eviction for the reference forward."""

    name = "fixed-test"

    def __init__(self, seed: int):
        self.seed = seed

    def score(self, head: HeadView) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 31 + head.head)
        table = torch.rand(4096, generator=g)
        return table[head.positions.long()]


def run_with_cache(model, ctx, new, compress_fn=None):
    """Prefill ctx, optionally compress, feed new. Returns logits and the positions kept per layer and
    head right after compression (what the new tokens could see)."""
    cache = KVCache(model.config)
    with torch.no_grad():
        model(input_ids=ctx, cache=cache, use_cache=True)
        if compress_fn:
            compress_fn(cache)
        kept = [[p.clone() for p in layer.head_positions] for layer in cache.layers]
        logits = model(input_ids=new, cache=cache, use_cache=True).logits
    return logits, cache, kept


def reference_logits(model, ctx, new, cache: KVCache, kept_positions):
    """Full forward over ctx+new where the new tokens cannot see what `cache` evicted (per KV head).
    Layers of one type evict the same tokens by construction (FixedScores), so one mask per type."""
    cfg = model.config
    n_ctx, n_new = ctx.shape[1], new.shape[1]
    total = n_ctx + n_new
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    i = torch.arange(total)

    def mask_for(layer_idx):
        layer = cache.layers[layer_idx]
        allowed = torch.ones(cfg.num_attention_heads, total, total, dtype=torch.bool).tril()
        for qh in range(cfg.num_attention_heads):
            kept = kept_positions[layer_idx][qh // groups]
            visible = torch.zeros(n_ctx, dtype=torch.bool)
            visible[kept[kept < n_ctx].long()] = True
            allowed[qh, n_ctx:, :n_ctx] &= visible
        if layer.is_sliding:
            allowed &= (i[:, None] - i[None, :]) < cfg.sliding_window
        return allowed[None]

    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        mask = {t: mask_for(layer_types.index(t)) for t in set(layer_types)}
    else:
        mask = mask_for(0)
    with torch.no_grad():
        return model(input_ids=torch.cat([ctx, new], 1), attention_mask=mask).logits[:, n_ctx:]


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_keep_all_is_identical(kind, request):
    model = request.getfixturevalue(kind)
    ctx, new = random_ids(30, 1), random_ids(4, 2)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        model(input_ids=ctx, cache=dyn, use_cache=True)
        expected = model(input_ids=new, cache=dyn, use_cache=True).logits
    for method in ("full", "snapkv", "knorm"):
        got, _, _ = run_with_cache(model, ctx, new, lambda c: compress(c, get_method(method), 1.0))
        assert torch.equal(got, expected), method


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["tiny_llama", "tiny_gemma"]),
    ratio=st.floats(0.05, 1.0),
    n_ctx=st.integers(6, 40),
    n_new=st.integers(1, 5),
    seed=st.integers(0, 1000),
    budget=st.sampled_from(["uniform", "adaptive"]),  # layer-equal decisions: one reference mask per layer type
)
def test_eviction_equals_masking(kind, ratio, n_ctx, n_new, seed, budget, request):
    model = request.getfixturevalue(kind)
    ctx, new = random_ids(n_ctx, seed), random_ids(n_new, seed + 1)
    method = FixedScores(seed)
    method.budget = budget
    got, cache, kept = run_with_cache(model, ctx, new, lambda c: compress(c, method, ratio))
    expected = reference_logits(model, ctx, new, cache, kept)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(ratio=st.floats(0.01, 1.0), n_ctx=st.integers(2, 60), seed=st.integers(0, 100))
def test_uniform_budget_and_bytes(tiny_llama, ratio, n_ctx, seed):
    _, cache, _ = run_with_cache(tiny_llama, random_ids(n_ctx, seed), random_ids(1, 0))
    n_held = n_ctx + 1
    before = cache.kv_bytes()
    res = compress(cache, FixedScores(seed), ratio)
    head_dim = tiny_llama.config.hidden_size // tiny_llama.config.num_attention_heads
    for layer in cache.layers:
        assert layer.lengths() == [max(1, math.ceil(ratio * n_held))] * layer.num_heads
        for p in layer.head_positions:
            assert torch.all(p[1:] > p[:-1])  # sorted, unique, subset of the original positions
            assert int(p.max()) < n_held
    row_bytes = head_dim * 4 * 2 * 2 * 2  # float32 keys + values, 2 heads x 2 layers
    # before: the live rows plus the spare rows the last append grew the buffers by (measured, not assumed)
    assert res.kv_bytes_before == before
    assert n_held * row_bytes <= before <= (n_held + 1 + GROW) * row_bytes
    if ratio < 1.0:  # evicted layers are stored exactly
        tokens = sum(map(sum, cache.tokens_held()))
        assert res.kv_bytes_after == cache.kv_bytes() == tokens * head_dim * 2 * 4


def test_adaptive_budget_gives_heads_different_lengths(tiny_llama):
    class Skewed(Method):
        name = "skewed-test"

        def score(self, head):  # head 0's scores are peaked, head 1's flat: adaptive gives head 0 less
            return torch.linspace(0, 10, head.positions.numel()) if head.head == 0 else torch.zeros(head.positions.numel())

    _, cache, _ = run_with_cache(tiny_llama, random_ids(50, 3), random_ids(1, 4))
    method = Skewed()
    method.budget = "adaptive"
    compress(cache, method, 0.5)
    lengths = cache.tokens_held()[0]
    assert lengths[0] != lengths[1]
    assert lengths[1] >= 5  # Ada-KV's floor: 20% of the uniform share
    assert sum(lengths) == 2 * 26  # the layer's budget (ceil(0.5 * 51) per head), pooled
    head_dim = 16
    assert cache.kv_bytes() == sum(map(sum, cache.tokens_held())) * head_dim * 2 * 4


def test_sliding_layers_hold_only_the_window(tiny_gemma):
    _, cache, _ = run_with_cache(tiny_gemma, random_ids(30, 5), random_ids(3, 6))
    window = tiny_gemma.config.sliding_window
    for layer in cache.layers:
        expected = window - 1 if layer.is_sliding else 33
        assert layer.lengths() == [expected] * layer.num_heads
        if layer.is_sliding:  # rows beyond the window are freed, not just hidden
            head_dim = tiny_gemma.config.head_dim
            assert storage_bytes(layer.kv_tensors()) == layer.num_heads * expected * head_dim * 4 * 2


def test_sliding_keep_leaves_sliding_layers_whole(tiny_gemma):
    """`sliding=keep` compresses only the global layers (sliding ones are bounded by their window already),
    after the prefill and as the model runs; the default compresses every layer."""
    from kvmem.compress import Compressor

    ctx, new = random_ids(40, 9), random_ids(3, 10)
    window = tiny_gemma.config.sliding_window
    _, _, kept = run_with_cache(tiny_gemma, ctx, new, lambda c: compress(c, get_method("knorm:sliding=keep"), 0.25))
    _, _, both = run_with_cache(tiny_gemma, ctx, new, lambda c: compress(c, get_method("knorm"), 0.25))
    live = KVCache(tiny_gemma.config, compressor=Compressor(get_method("knorm:sliding=keep"), 0.25))
    with torch.no_grad():
        tiny_gemma(input_ids=ctx, cache=live, use_cache=True)
    sliding = [layer.is_sliding for layer in live.layers]
    assert any(sliding) and not all(sliding)
    for is_sliding, a, b, c in zip(sliding, kept, both, live.layers):
        if is_sliding:
            assert [len(p) for p in a] == c.lengths() == [window - 1] * c.num_heads
            assert max(len(p) for p in b) < window - 1
        else:
            assert [len(p) for p in a] == [len(p) for p in b] == c.lengths() == [math.ceil(0.25 * 40)] * c.num_heads
    assert get_method("knorm:sliding=keep").spec == "knorm:sliding=keep" and get_method("knorm").spec == "knorm"
    # a whole-cache budget shares among the layers that are compressed (the global ones here)
    _, _, pooled = run_with_cache(tiny_gemma, ctx, new,
                                  lambda c: compress(c, get_method("random:budget=global:sliding=keep"), 0.25))
    held = [sum(map(len, layer)) for layer, s in zip(pooled, sliding) if not s]
    assert sum(held) == sum(math.ceil(0.25 * 40) * c.num_heads for c, s in zip(live.layers, sliding) if not s)
    assert [len(p) for layer, s in zip(pooled, sliding) if s for p in layer] == [window - 1] * sum(
        c.num_heads for c, s in zip(live.layers, sliding) if s)


def test_positions_continue_after_eviction(tiny_llama):
    _, cache, _ = run_with_cache(tiny_llama, random_ids(20, 7), random_ids(2, 8),
                              lambda c: compress(c, get_method("streaming-llm"), 0.3))
    assert cache.get_seq_length() == 22
    p = cache.layers[0].head_positions[0]
    assert p[-2:].tolist() == [20, 21] and p[:4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5, float("nan")])
def test_bad_keep_ratio_is_a_clear_error(tiny_llama, ratio):
    _, cache, _ = run_with_cache(tiny_llama, random_ids(8, 0), random_ids(1, 0))
    with pytest.raises(KVMemError, match="keep ratio"):
        compress(cache, get_method("knorm"), ratio)


def test_other_clear_errors(tiny_llama):
    _, cache, _ = run_with_cache(tiny_llama, random_ids(8, 0), random_ids(1, 0))
    with pytest.raises(KVMemError, match="unknown method"):
        get_method("snapkv2")
    with pytest.raises(KVMemError, match="full"):
        compress(cache, get_method("full"), 0.5)
    with pytest.raises(KVMemError, match="per-layer"):
        compress(cache, get_method("knorm"), [0.5, 0.5, 0.5])
    with pytest.raises(KVMemError, match="track_attention"):
        compress(cache, get_method("h2o"), 0.5)
    with pytest.raises(KVMemError, match="batch size"):
        tiny_llama(input_ids=random_ids(8, 0).repeat(2, 1), cache=KVCache(tiny_llama.config), use_cache=True)


def test_clone_is_independent(tiny_llama):
    _, cache, _ = run_with_cache(tiny_llama, random_ids(20, 9), random_ids(1, 0))
    copy = cache.clone()
    compress(copy, get_method("knorm"), 0.25)
    assert cache.tokens_held()[0] == [21, 21] and copy.tokens_held()[0] == [6, 6]
    assert cache.kv_bytes() > copy.kv_bytes()


def test_pyramid_budget_shrinks_with_depth_and_keeps_the_total():
    from kvmem.compress.budget import allocate

    scores = {layer: [torch.rand(1000) for _ in range(3)] for layer in range(30)}
    shares = {layer: [250] * 3 for layer in range(30)}
    counts = allocate("pyramid", scores, shares, range(30))
    per_layer = [counts[layer][0] for layer in range(30)]
    assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > 2 * per_layer[-1]
    assert abs(per_layer[-1] - 250 / 20) <= 2  # the top layer keeps about share / beta
    assert 30 * 250 - 1 <= sum(per_layer) <= 30 * 250  # the mean is the uniform share, never more
    high = allocate("pyramid", scores, {layer: [800] * 3 for layer in range(30)}, range(30))
    assert high[0] == [1000] * 3 and 30 * 800 - 1 <= sum(c[0] for c in high.values()) <= 30 * 800  # capped by a head's rows
    tiny = allocate("pyramid", {layer: [torch.rand(2)] for layer in range(30)}, {layer: [1] for layer in range(30)}, range(30))
    assert [c[0] for c in tiny.values()] == [1] * 30  # a one-token share: one token everywhere, not more


def test_global_budget_pools_layers_and_heads():
    from kvmem.compress.budget import allocate

    scores = {0: [torch.full((100,), 5.0), torch.zeros(100)], 1: [torch.ones(100), torch.zeros(100)]}
    counts = allocate("global", scores, {0: [50, 50], 1: [50, 50]}, range(2))
    assert counts == {0: [100, 1], 1: [98, 1]}  # the top 200 scores, and at least one token per head
    # layers left whole (keep ratio 1, sliding=keep) are not in the pool; layer by layer is refused up front
    assert allocate("global", {0: scores[0]}, {0: [50, 50]}, range(2)) == {0: [99, 1]}
    from kvmem.compress import Compressor

    for spec in ("random:budget=global", "knorm:budget=duo", "knorm:budget=razor"):
        with pytest.raises(KVMemError, match="compares heads of all layers"):
            Compressor(get_method(spec), 0.3)


def test_duo_budget_gives_retrieval_heads_everything_and_shares_the_rest():
    from kvmem.compress.budget import STREAMING_MIN, allocate

    scores = {layer: [torch.rand(1000) for _ in range(2)] for layer in range(3)}
    shares = {layer: [300, 300] for layer in range(3)}  # 1800 tokens in all
    probe = {0: torch.tensor([0.0, 0.9]), 1: torch.tensor([0.5, 0.0]), 2: torch.tensor([0.1, 0.2])}
    counts = allocate("duo", scores, shares, range(3), probe)
    assert counts[0][1] == 1000  # the best retrieval head keeps everything
    assert counts[1][0] < 1000  # a second full head (2000 tokens) does not fit the 1800
    streaming = [counts[layer][h] for layer in range(3) for h in range(2) if (layer, h) != (0, 1)]
    assert len(set(streaming)) == 1 and streaming[0] == (1800 - 1000) // 5 >= STREAMING_MIN
    assert sum(map(sum, counts.values())) <= 1800
    none = allocate("duo", scores, shares, range(3), {layer: torch.zeros(2) for layer in range(3)})
    assert none == {layer: [300, 300] for layer in range(3)}  # no head ever retrieves: an even split


@pytest.mark.parametrize("ragged", [False, True])
def test_a_weighted_row_counts_as_that_many_tokens(tiny_llama, ragged):
    """A row with log-weight log(n) (RazorAttention's compensation token) attends exactly like n copies of it."""
    ctx, new = random_ids(20, 11), random_ids(2, 12)

    def build(copies: bool):
        cache = KVCache(tiny_llama.config)
        with torch.no_grad():
            tiny_llama(input_ids=ctx, cache=cache, use_cache=True)
        for layer in cache.layers:
            drop = {5, 6, 7} | ({8} if ragged else set())
            keep = [torch.tensor([i for i in range(20) if i not in drop or (ragged and h == 1 and i == 8)])
                    for h in range(layer.num_heads)]
            mean = [(layer.head_keys[h][5:8].mean(0), layer.head_values[h][5:8].mean(0)) for h in range(layer.num_heads)]
            layer.keep_only(keep)
            if copies:
                for p in (5, 6, 7):
                    layer.add_rows([(k, v, p, 0.0) for k, v in mean])
            else:
                layer.add_rows([(k, v, 7, math.log(3)) for k, v in mean])
        with torch.no_grad():
            return tiny_llama(input_ids=new, cache=cache, use_cache=True).logits, cache

    weighted, cache = build(False)
    copied, _ = build(True)
    torch.testing.assert_close(weighted, copied, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].dense != ragged
    w, p = cache.layers[0].log_weights[0], cache.layers[0].head_positions[0]
    assert w[p == 7].item() == pytest.approx(math.log(3)) and (w[p != 7] == 0).all()  # new tokens weigh one
    with pytest.raises(KVMemError, match="already holds"):
        cache.layers[0].add_rows([(torch.zeros(16), torch.zeros(16), 0, 0.0), None])


@pytest.mark.parametrize("spec", ["snapkv:window=0", "snapkv:kernel_size=4", "expected-attention:window=1",
                                  "curdkv:window=-1", "q-filters:samples=0", "kvzip:chunk=0", "kvzip-head:length=3",
                                  "keydiff:budget=nope", "knorm:foo=1", "snapkv:window=abc", "knorm:sliding=drop",
                                  "full:sliding=keep"])
def test_bad_method_options_are_named_errors(spec):
    with pytest.raises(KVMemError):
        get_method(spec)

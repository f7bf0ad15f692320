"""`attention-matching` (compress/attention_matching.py): kept keys, fitted log-weights and refit values that reproduce
the full head's attention for the reference queries, on the real SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.compress import METHODS, Compressor, compress, get_method
from kvmem.compress.attention_matching import AttentionMatching
from kvmem.compress.attention_matching import MIN_WEIGHT
from kvmem.compress.base import HeadView, ModelContext
from kvmem.compress.evict import head_views
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.quant import get_scheme

TEXT = ("The history of the city begins with a small fishing village on the river. Merchants arrived, built "
        "warehouses, and a market grew around the old stone bridge. ") * 12


class TopT(AttentionMatching):
    """The same selection without steps 2 and 3: plain top-t eviction by the same attention score."""

    name = "top-t"

    def refit(self, head: HeadView, chosen: torch.Tensor, n: int) -> None:
        return None


@pytest.fixture(scope="module")
def prefilled(smollm2):
    ids = smollm2.tokenizer(TEXT).input_ids[:300]
    assert len(ids) == 300
    cache = KVCache(smollm2.model.config, observe_window=64)
    feed(smollm2, cache, ids)
    return cache


@pytest.fixture(scope="module")
def context(smollm2):
    """The ids `prefilled` holds: the default reference queries replay them (once, memoized for every copy)."""
    return ModelContext(smollm2, smollm2.tokenizer(TEXT).input_ids[:300])


def compacted(cache: KVCache, context: ModelContext, method: AttentionMatching, ratio: float = 0.25) -> KVCache:
    out = cache.clone()
    compress(out, method, ratio, context=context)
    return out


def attention_errors(full: KVCache, cache: KVCache, method: AttentionMatching) -> tuple[float, float]:
    """Mean over heads of the relative error of the reference queries' attention output, and of the mean absolute
    difference of their log-sum-exp (the attention mass, row log-weights included), compacted vs full."""
    out, mass = [], []
    for i, (a, b) in enumerate(zip(full.layers, cache.layers)):
        for whole, small in zip(head_views(a, i), head_views(b, i)):
            lf, lc = method._logits(whole), method._logits(small)
            yf, yc = lf.softmax(-1) @ whole.values.float(), lc.softmax(-1) @ small.values.float()
            out.append(float((yc - yf).norm() / yf.norm()))
            mass.append(float((lc.logsumexp(-1) - lf.logsumexp(-1)).abs().mean()))
    return sum(out) / len(out), sum(mass) / len(mass)


def test_matches_the_full_heads_attention_far_better_than_top_t_eviction(prefilled, context):
    am, plain = get_method("attention-matching"), TopT()
    out_am, mass_am = attention_errors(prefilled, compacted(prefilled, context, am), am)
    out_plain, mass_plain = attention_errors(prefilled, compacted(prefilled, context, plain), am)
    print(f"relative output error: attention-matching {out_am:.3f}, top-t {out_plain:.3f}; "
          f"|log-mass error|: {mass_am:.3f} vs {mass_plain:.3f}")
    # measured on the prompt's 900 queries a head (75 rows kept of 300): 0.320 vs 0.489, and 0.266 vs 0.599 nats
    assert out_am < 0.75 * out_plain
    assert mass_am < 0.6 * mass_plain and mass_am < 0.35


def test_frees_memory_still_generates_and_counts_the_weights(smollm2, prefilled, context):
    am = compacted(prefilled, context, get_method("attention-matching"))
    plain = compacted(prefilled, context, TopT())
    assert am.kv_bytes() == plain.kv_bytes() < 0.3 * prefilled.kv_bytes()
    rows = sum(map(sum, am.tokens_held()))
    assert all(layer.log_weights is not None and [w.numel() for w in layer.log_weights] == layer.lengths()
               for layer in am.layers)
    # one float per row: the log-weights are the only state the plain top-t cache lacks
    assert am.state_bytes() - plain.state_bytes() == rows * am.layers[0].log_weights[0].element_size()
    ids = smollm2.tokenizer(" The market", add_special_tokens=False).input_ids
    logits = feed(smollm2, am, ids)
    assert torch.isfinite(logits).all()
    token = int(logits[-1].argmax())
    for _ in range(3):  # greedy decoding over the compacted cache (log-weighted rows in the mask)
        logits = feed(smollm2, am, [token])
        assert torch.isfinite(logits).all()
        token = int(logits[-1].argmax())
    # and layer by layer inside model.generate, on the observed window's queries (the default replays the prompt, so
    # it needs the model and is refused there by name)
    with pytest.raises(KVMemError, match="needs the model"):
        Compressor(get_method("attention-matching"), 0.25)
    ids = torch.tensor([smollm2.tokenizer(TEXT).input_ids[:300]])
    cache = KVCache(smollm2.model.config, compressor=Compressor(get_method("attention-matching:queries=window"), 0.25))
    out = smollm2.model.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 304 and all(layer.log_weights is not None for layer in cache.layers)
    assert sum(map(sum, cache.tokens_held())) < 0.3 * sum(map(sum, prefilled.tokens_held())) + 4 * 90


def test_refits_values_of_the_same_kept_rows_as_top_t(prefilled, context):
    """Not a sibling in disguise: the kept keys are a plain attention top-t (by construction: step 1 of the paper is
    exactly that selection, `TopT` here), but the rows then hold refit values and fitted log-weights."""
    am = compacted(prefilled, context, get_method("attention-matching"))
    plain = compacted(prefilled, context, TopT())
    changed, heads = 0, 0
    for a, p, full in zip(am.layers, plain.layers, prefilled.layers):
        for (k, v, pos), (kp, vp, posp), (kf, vf, posf), w in zip(a.rows.heads(), p.rows.heads(), full.rows.heads(),
                                                                   a.log_weights):
            assert torch.equal(pos, posp) and torch.equal(k, kp)  # the same kept rows, keys as they were
            original = vf[torch.searchsorted(posf, pos)]  # the same tokens' values before compaction
            assert torch.equal(vp, original) and torch.equal(kf[torch.searchsorted(posf, pos)], k)
            changed += int(not torch.allclose(v, original, atol=1e-3))
            heads += 1
            assert torch.isfinite(w).all() and bool((w != 0).any())  # fitted weights, not the one-token zeros
    assert changed == heads  # every head's values were refit


@pytest.mark.parametrize("spec, named", [
    ("attention-matching:window=0", "window=0"),
    ("attention-matching:score=rms", "score='rms'"),
    ("attention-matching:ridge=-1", "ridge=-1"),
    ("attention-matching:queries=all", "queries='all'"),
    ("attention-matching:max_queries=0", "max_queries=0"),
    ("attention-matching:colour=1", "colour"),
])
def test_bad_options_raise_naming_them(spec, named):
    with pytest.raises(KVMemError, match=named.replace("(", r"\(")):
        get_method(spec)


@pytest.mark.parametrize("method", ["attention-matching:queries=window", "subgen"])  # every method that rewrites rows
def test_refuses_what_it_cannot_rewrite(smollm2, prefilled, method, context):
    with pytest.raises(KVMemError, match="razor"):
        compress(prefilled.clone(), get_method(f"{method}:budget=razor"), 0.25, context=context)
    ids = smollm2.tokenizer(TEXT).input_ids[:100]
    for spec in ("kivi-4", "mikv"):
        cache = KVCache(smollm2.model.config, quant=get_scheme(spec, smollm2),
                        compressor=Compressor(get_method(method), 0.25))
        with pytest.raises(KVMemError, match="quantized or mixed-precision"):
            feed(smollm2, cache, ids)


def test_registered():
    assert METHODS["attention-matching"] is AttentionMatching
    assert get_method("attention-matching:window=32:ridge=0.001").spec == "attention-matching:ridge=0.001:window=32"


def test_prompt_queries_weight_the_kept_rows_where_a_window_cannot(prefilled, context):
    """Why the prompt's replayed queries are the default: with fewer reference queries than kept rows (a 16-query
    window x 3 query heads = 48 against 150 rows a head at keep 0.5), NNLS leaves at most 48 rows a head a weight
    above its floor and silences the rest; the prompt's 900 queries a head weight most of them."""
    def alive(cache: KVCache) -> float:
        weights = torch.cat([w for layer in cache.layers for w in layer.log_weights])
        return float((weights > math.log(MIN_WEIGHT) + 1).float().mean())

    window = compacted(prefilled, context, get_method("attention-matching:queries=window:window=16"), 0.5)
    prompt = compacted(prefilled, context, get_method("attention-matching"), 0.5)
    print(f"rows weighted above the floor: window {alive(window):.2f}, prompt {alive(prompt):.2f}")
    assert alive(window) <= 48 / 150 + 1e-6
    assert alive(prompt) > 0.6

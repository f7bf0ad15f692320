"""moment-kv (Moment-KV, arXiv 2605.29873): the cache tracks each row's attention momentum, checked against a decayed
sum of transformers' own eager attention over the same tokens; the prompt's rows are never evicted; the generated rows
it keeps are neither h2o's (undecayed sum) nor tova's (last query) choice; memory is freed; bad options are refused."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import Compressor, compress, get_method
from kvmem.compress.evict import head_views
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer, decode, new_cache, prepare
from kvmem.prompts import build_prompt
from kvmem.models import cache_dir

N_PROMPT, N_GEN = 120, 40
GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
LAYERS = (0, 7, 29)
DECAY = 0.8


@pytest.fixture(scope="module")
def run(smollm2):
    """A prompt read in one forward, then N_GEN tokens one at a time into a moment-kv cache (nothing evicted), and
    transformers' eager attention over the same N_PROMPT + N_GEN tokens."""
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_PROMPT + N_GEN]
    cache = new_cache(smollm2, get_method(f"moment-kv:decay={DECAY}"))
    feed(smollm2, cache, ids[:N_PROMPT])
    for t in ids[N_PROMPT:]:
        feed(smollm2, cache, [t])
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return ids, cache, [a[0] for a in attentions]  # per layer (query heads, T, T)


def momentum(attn, h: int, decay: float) -> torch.Tensor:
    """Eq. 5 unrolled: I_i(t) = sum_s decay^(t-s) a_i(s) over every query s up to the last one, t; group mean."""
    a = attn[h * GROUPS:(h + 1) * GROUPS]  # (group, T queries, T keys)
    t = a.shape[1]
    weights = decay ** torch.arange(t - 1, -1, -1, dtype=torch.float64)
    return torch.einsum("gqk,q->gk", a.double(), weights).mean(dim=0).float()


def test_score_is_the_decayed_sum_of_eager_attention(run):
    _, cache, attn = run
    method = get_method(f"moment-kv:decay={DECAY}")
    for layer in LAYERS:
        for view in head_views(cache.layers[layer], layer):
            expected = momentum(attn[layer], view.head, DECAY)
            score = method.score(view)
            torch.testing.assert_close(score, expected, atol=2e-4, rtol=1e-3)
            # not the plain sum H2O reads: the decay is really applied
            assert not torch.allclose(score, momentum(attn[layer], view.head, 1.0), atol=1e-2)


def test_plain_tracking_is_refused_and_h2o_refuses_a_momentum(run, smollm2):
    ids, cache, _ = run
    plain = KVCache(smollm2.model.config, track_attention=True)
    feed(smollm2, plain, ids[:N_PROMPT])
    feed(smollm2, plain, ids[N_PROMPT:N_PROMPT + 4])
    with pytest.raises(KVMemError, match="decay 0.9 a step; this cache tracks it with decay 1"):
        compress(plain, get_method("moment-kv"), 0.5)
    with pytest.raises(KVMemError, match="decay 1 a step; this cache tracks it with decay 0.8"):
        compress(cache.clone(), get_method("h2o"), 0.5)


def generated(positions: torch.Tensor) -> set[int]:
    return {p for p in positions.tolist() if p >= N_PROMPT}


def test_keeps_the_prompt_and_the_top_momentum_generated_rows(run):
    """compress() on the decoded cache: every prompt row stays, each head keeps ceil(r x generated rows) of the
    others, the ones of highest momentum; not those of the highest plain sum (h2o's score) nor of the last query's
    attention (tova's), nor random ones; with decay 1 the choice is the plain sum's."""
    _, cache, attn = run
    r = 0.25
    n_keep = math.ceil(r * N_GEN)
    c = cache.clone()
    compress(c, get_method(f"moment-kv:decay={DECAY}"), r)
    differs = {"h2o": 0, "tova": 0}
    for li, layer in enumerate(c.layers):
        for h, p in enumerate(layer.head_positions):
            assert p[:N_PROMPT].tolist() == list(range(N_PROMPT)) and len(p) == N_PROMPT + n_keep
            if li not in LAYERS:
                continue
            kept = generated(p)
            top = lambda s: {N_PROMPT + int(i) for i in s[N_PROMPT:].topk(n_keep).indices}  # noqa: E731
            assert kept == top(momentum(attn[li], h, DECAY))
            differs["h2o"] += kept != top(momentum(attn[li], h, 1.0))
            differs["tova"] += kept != top(attn[li][h * GROUPS:(h + 1) * GROUPS, -1].mean(dim=0))
    assert differs["h2o"] > 0 and differs["tova"] > 0
    rnd = cache.clone()
    compress(rnd, get_method("random"), r)
    assert [generated(p) for p in c.layers[7].head_positions] != [generated(p) for p in rnd.layers[7].head_positions]


def test_recent_keeps_the_newest_generated_rows_then_the_top_momentum(run):
    """moment-kv:recent=4: each head keeps its 4 newest generated rows, the rest of its budget by momentum; without
    `recent` the newest rows are not all kept (the row just generated has one step of attention)."""
    _, cache, attn = run
    n_keep, recent = math.ceil(0.25 * N_GEN), 4
    newest = set(range(N_PROMPT + N_GEN - recent, N_PROMPT + N_GEN))
    c, plain = cache.clone(), cache.clone()
    compress(c, get_method(f"moment-kv:decay={DECAY}:recent={recent}"), 0.25)
    compress(plain, get_method(f"moment-kv:decay={DECAY}"), 0.25)
    for li in LAYERS:
        for h, p in enumerate(c.layers[li].head_positions):
            kept = generated(p)
            assert len(kept) == n_keep and newest <= kept
            older = momentum(attn[li], h, DECAY)[N_PROMPT:N_PROMPT + N_GEN - recent]
            assert kept - newest == {N_PROMPT + int(i) for i in older.topk(n_keep - recent).indices}
    assert any(not newest <= generated(p) for li in LAYERS for p in plain.layers[li].head_positions)


def test_memory_is_freed_and_the_fixed_decode_budget(run, smollm2):
    _, cache, _ = run
    keys = cache.layers[0].head_keys[0]
    row_bytes = 2 * keys.shape[-1] * keys.element_size()  # a key and a value (the full cache has room to grow)
    c = cache.clone()
    result = compress(c, get_method(f"moment-kv:decay={DECAY}"), 0.5)
    rows = len(c.layers) * 3 * (N_PROMPT + N_GEN // 2)
    assert c.kv_bytes() == result.kv_bytes_after == rows * row_bytes < cache.kv_bytes()
    fixed = cache.clone()
    compress(fixed, get_method(f"moment-kv:decay={DECAY}:decode_budget=7"), 1.0)
    assert fixed.tokens_held() == [[N_PROMPT + 7] * 3] * len(fixed.layers)
    assert fixed.kv_bytes() == len(fixed.layers) * 3 * (N_PROMPT + 7) * row_bytes
    logits = feed(smollm2, fixed, smollm2.tokenizer(" and", add_special_tokens=False).input_ids)
    assert torch.isfinite(logits).all()


def test_a_prompt_alone_has_nothing_to_evict(run, smollm2):
    ids, _, _ = run
    cache = new_cache(smollm2, get_method("moment-kv"))
    feed(smollm2, cache, ids[:N_PROMPT])
    before = cache.kv_bytes()
    result = compress(cache, get_method("moment-kv"), 0.25)
    assert result.tokens_after == result.tokens_before and cache.kv_bytes() == before


@pytest.mark.parametrize("spec,ratio,every", [("moment-kv", 0.25, 4), ("moment-kv:decode_budget=6", 1.0, 1)])
def test_model_generate_with_a_compressor_keeps_the_prompt_and_the_decode_budget(smollm2, spec, ratio, every):
    ids = torch.tensor([smollm2.tokenizer(open(__file__).read()).input_ids[:N_PROMPT]])
    n_new = 30
    cache = KVCache(smollm2.model.config, compressor=Compressor(get_method(spec), ratio, every=every))
    assert cache.layers[0].observation.decay == 0.9  # the compressor's method switched the momentum on
    out = smollm2.model.generate(input_ids=ids, cache=cache, max_new_tokens=n_new, do_sample=False)
    assert out.shape[1] == N_PROMPT + n_new
    fed = n_new - 1  # the last token generated is not fed back
    last_round = fed - fed % every  # tokens generated when the compressor last ran
    cap = math.ceil(ratio * last_round) if "decode_budget" not in spec else 6
    for layer in cache.layers:
        for p in layer.head_positions:
            assert p[:N_PROMPT].tolist() == list(range(N_PROMPT))  # the prefill is never evicted
            assert len(p) == N_PROMPT + cap + fed - last_round
            # rows generated since the last round are all held (no recency window otherwise: a row's first step
            # of attention may not earn it a place)
            assert p[len(p) - (fed - last_round):].tolist() == list(range(N_PROMPT + last_round, N_PROMPT + fed))


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])  # Llama GQA; Gemma 3 sliding-window MQA
@pytest.mark.parametrize("spec,ratio", [("moment-kv:decode_budget=4", 1.0), ("moment-kv:recent=2", 0.25)])
def test_the_one_call_path_evicts_while_it_decodes(request, model, spec, ratio):
    """`prepare` (answer, kvmem generate, the server) reads the prompt whole, then the cache evicts at every decoding
    step: each head holds the prompt + decode_budget (or ceil(ratio x generated)) rows, never evicting the prompt."""
    lm = request.getfixturevalue(model)
    prompt = build_prompt(lm.tokenizer, "Rome is a city in Italy.", "Write a long poem about Rome.")
    p = prepare(lm, prompt, spec, ratio)
    n_prompt, kv_heads = len(prompt.ids), lm.model.config.num_key_value_heads
    assert p.kv_bytes == p.kv_bytes_full and p.cache.tokens_held() == [[n_prompt] * kv_heads] * len(p.cache.layers)
    decode(lm, p.cache, p.logits, 24, stop_at_newline=False)
    fed = p.cache.get_seq_length() - n_prompt
    assert fed > 8
    cap = 4 if "decode_budget" in spec else math.ceil(ratio * fed)
    for layer in p.cache.layers:
        for positions in layer.head_positions:
            assert positions[:n_prompt].tolist() == list(range(n_prompt)) and len(positions) == n_prompt + cap
            if "recent" in spec:
                assert positions[-2:].tolist() == [n_prompt + fed - 2, n_prompt + fed - 1]
    assert answer(lm, "Rome is a city in Italy.", "Where is Rome?", spec, ratio, max_new_tokens=8).tokens


def test_bad_options_are_refused_by_name(smollm2):
    for spec, name in [("moment-kv:decay=0", "decay"), ("moment-kv:decay=1.5", "decay"),
                       ("moment-kv:decode_budget=0", "decode_budget"), ("moment-kv:decode_budget=2.5", "decode_budget"),
                       ("moment-kv:recent=-1", "recent"),
                       ("moment-kv:window=8", "window")]:
        with pytest.raises(KVMemError, match=name):
            get_method(spec)
    with pytest.raises(KVMemError, match="decode_budget=4"):
        Compressor(get_method("moment-kv:decode_budget=4"), 0.5)(_decoded_layer(smollm2), 0)
    with pytest.raises(KVMemError, match="attention_decay"):
        KVCache(smollm2.model.config, track_attention=True, attention_decay=0.0)


def _decoded_layer(lm):
    cache = new_cache(lm, get_method("moment-kv:decode_budget=4"))
    feed(lm, cache, [1, 2, 3])
    return cache.layers[0]

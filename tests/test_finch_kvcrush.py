"""FINCH and KVCrush (issue 35), each checked on an independent path: transformers' own eager model. FINCH's chunked
procedure is rerun on a transformers DynamicCache (each chunk and the question fed at their original positions, the
question's attention read from `output_attentions`, the cache cut by hand), and must keep the same positions with
the same keys and values; KVCrush's head-behaviour bits and Hamming distances are rebuilt from the eager attention, its
representatives picked as the reference does. Each keeps other tokens than its nearest sibling and `random`, frees
memory, runs from the API that fits it, and refuses bad options by name."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvmem.cache import KVCache
from kvmem.compress import Compressor, ModelContext, compress, get_method
from kvmem.compress.evict import head_views
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir
from kvmem.quant import get_scheme

N_CTX = 150
CHUNK = 64
RATIO = 0.3
HEADS = 9  # SmolLM2: 9 query heads, 3 KV heads, 30 layers
LAYERS = 30


@pytest.fixture(scope="module")
def setup(smollm2):
    """The document ids, the question, kvmem caches prefilled with the document (+ the question but its last token,
    as the query-aware setting holds it), and transformers' eager model."""
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:N_CTX]
    question = smollm2.tokenizer(" Which chunk is kept?", add_special_tokens=False).input_ids[:-1]
    aware = KVCache(smollm2.model.config, observe_window=64)
    feed(smollm2, aware, ids + question)
    agnostic = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, agnostic, ids)
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    return ids, question, aware, agnostic, eager.eval()


def finch(setup, lm, spec: str = f"finch:chunk={CHUNK}", ratio: float = RATIO) -> KVCache:
    ids, question, aware = setup[:3]
    cache = aware.clone()
    compress(cache, get_method(spec), ratio, protect_from=len(ids), context=ModelContext(lm, ids, question=question))
    return cache


def positions(cache: KVCache) -> list[list[list[int]]]:
    return [[p.tolist() for p in layer.head_positions] for layer in cache.layers]


@torch.no_grad()
def finch_on_transformers(eager, ids: list[int], prompt: list[int], normalize: bool = True):
    """FINCH as the reference runs it (`condition="question"`), on a DynamicCache: per layer the kept positions and
    the final cache."""
    n, budget = len(ids), math.ceil(RATIO * len(ids))
    hf = DynamicCache(config=eager.config)
    kept = [torch.zeros(0, dtype=torch.long) for _ in range(LAYERS)]
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        x, held = ids[c0:c1] + prompt, hf.get_seq_length()
        out = eager(input_ids=torch.tensor([x]), position_ids=torch.arange(c0, c0 + len(x))[None],
                    cache_position=torch.arange(held, held + len(x)), cache=hf, use_cache=True,
                    output_attentions=True)
        for layer in range(LAYERS):
            att = out.attentions[layer][0, :, -len(prompt):]  # (heads, prompt, keys): the prompt's rows
            keys = att.shape[-1]
            if normalize:  # keys each prompt query sees / keys
                att = att * (torch.arange(keys - len(prompt) + 1, keys + 1).float() / keys)[None, :, None]
            score = att.sum(dim=(0, 1))[:keys - len(prompt)]  # every head, every prompt query; past and chunk
            keep = score.topk(min(score.numel(), math.ceil(budget * c1 / n))).indices.sort().values
            if c1 == n:  # the question stays for the answer
                keep = torch.cat([keep, torch.arange(keys - len(prompt), keys)])
            where = torch.cat([kept[layer], torch.arange(c0, c1 + len(prompt))])
            cached = hf.layers[layer]
            cached.keys, cached.values = cached.keys[:, :, keep], cached.values[:, :, keep]
            kept[layer] = where[keep]
    return kept, hf


@pytest.mark.parametrize("normalize", [True, False])
def test_finch_keeps_what_the_question_attends_to_chunk_by_chunk_with_its_own_rows(smollm2, setup, normalize):
    ids, question, eager = setup[0], setup[1], setup[4]
    cache = finch(setup, smollm2, f"finch:chunk={CHUNK}:normalize={'true' if normalize else 'false'}")
    kept, hf = finch_on_transformers(eager, ids, question, normalize)
    for layer in range(LAYERS):
        for h, (k, v, p) in enumerate(cache.layers[layer].rows.heads()):
            assert p.tolist() == kept[layer].tolist(), (layer, h)  # one choice for the layer's heads
            # the rows are the chunked pass's (each chunk read over the compressed past), not the full prefill's
            torch.testing.assert_close(k.float(), hf.layers[layer].keys[0, h], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v.float(), hf.layers[layer].values[0, h], atol=1e-4, rtol=1e-4)
    full = setup[2].layers[LAYERS - 1].rows.heads()[0][1]
    assert not torch.allclose(cache.layers[LAYERS - 1].rows.heads()[0][1], full[kept[LAYERS - 1]], atol=1e-3)


def test_finch_is_not_snapkv_or_random_and_chunks_matter(smollm2, setup):
    ids, aware = setup[0], setup[2]
    kept = positions(finch(setup, smollm2))
    for sibling in ("snapkv", "random"):
        c = aware.clone()
        compress(c, get_method(sibling), RATIO, protect_from=len(ids))
        assert kept != positions(c), sibling
    assert kept != positions(finch(setup, smollm2, "finch"))  # one 512-token chunk: another selection


def test_finch_frees_memory_and_keeps_the_question(smollm2, setup):
    ids, question, aware = setup[:3]
    cache = aware.clone()
    result = compress(cache, get_method("finch"), RATIO, protect_from=len(ids),
                      context=ModelContext(smollm2, ids, question=question))
    assert cache.kv_bytes() == result.kv_bytes_after < 0.4 * aware.kv_bytes()
    n = len(ids) + len(question)
    for layer in cache.layers:
        for p in layer.head_positions:
            assert p.numel() == math.ceil(RATIO * len(ids)) + len(question)
            assert p[-len(question):].tolist() == list(range(len(ids), n))


def test_finch_answers_through_generate_and_refuses_what_it_cannot_do(smollm2, setup):
    from kvmem.generate import prepare
    from kvmem.prompts import build_prompt

    ids, question, aware = setup[:3]
    prompt = build_prompt(smollm2.tokenizer, "Alice has 3 cats. Bob has 5 dogs. " * 12, "How many dogs does Bob have?")
    pre = prepare(smollm2, prompt, "finch:chunk=64", 0.3, query_aware=True)
    assert pre.kv_bytes < 0.45 * pre.kv_bytes_full and torch.isfinite(pre.logits).all()
    with pytest.raises(KVMemError, match="question"):  # the cache holds a question the context does not give
        compress(aware.clone(), get_method("finch"), RATIO, context=ModelContext(smollm2, ids))
    with pytest.raises(KVMemError, match="needs the model"):
        Compressor(get_method("finch"), 0.3)
    quantized = aware.clone().quantize(get_scheme("kivi-2"))
    with pytest.raises(KVMemError, match="quantized"):
        compress(quantized, get_method("finch"), RATIO, protect_from=len(ids),
                 context=ModelContext(smollm2, ids, question=question))


@pytest.mark.parametrize("spec, option", [("finch:chunk=0", "chunk"), ("finch:window=0", "window"),
                                          ("finch:budget=adaptive", "budget"), ("finch:normalize=2", "normalize"),
                                          ("kvcrush:base=full", "base"), ("kvcrush:base=finch", "base"),
                                          ("kvcrush:fraction=0", "fraction"), ("kvcrush:fraction=1", "fraction"),
                                          ("kvcrush:anchor=median", "anchor"), ("kvcrush:source=keys", "source"),
                                          ("kvcrush:window=0", "window"), ("kvcrush:seed=x", "seed")])
def test_bad_options_are_refused_by_name(spec, option):
    with pytest.raises(KVMemError, match=option):
        get_method(spec)


def reference_kvcrush(attentions, cache: KVCache, anchor: str, fraction: float = 0.25):
    """KVCrush from the eager attention: bits = top half of each query head's attention from the last 32 queries,
    distance to the anchor, SnapKV's picks plus representatives evenly spaced over the dropped rows sorted by
    distance. Per layer and KV head, the kept positions."""
    snap, n_keep = get_method("snapkv"), math.ceil(RATIO * N_CTX)
    n_rep = int(fraction * n_keep)
    out = []
    for layer in range(LAYERS):
        a = attentions[layer][0, :, -32:, :].sum(dim=1)  # (query heads, tokens)
        bits = torch.zeros_like(a, dtype=torch.bool)
        bits[torch.arange(HEADS)[:, None], a.topk(N_CTX // 2, dim=1).indices] = True
        ref = bits.float().mean(dim=1) > 0.5 if anchor == "mean" else torch.arange(HEADS) % 2 == 1
        distance = (bits != ref[:, None]).sum(dim=0)
        heads = []
        for view in head_views(cache.layers[layer], layer):
            important = snap.select(view, snap.score(view), n_keep - n_rep).tolist()
            dropped = torch.tensor(sorted(set(range(N_CTX)) - set(important)))
            order = dropped[torch.sort(distance[dropped], stable=True).indices]
            heads.append(sorted(important + order[torch.arange(n_rep) * (len(order) // n_rep)].tolist()))
        out.append(heads)
    return out


@pytest.mark.parametrize("anchor", ["mean", "alternate"])
def test_kvcrush_is_snapkv_plus_representatives_of_head_behaviour(setup, anchor):
    ids, agnostic, eager = setup[0], setup[3], setup[4]
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    cache = agnostic.clone()
    compress(cache, get_method(f"kvcrush:anchor={anchor}"), RATIO)
    assert positions(cache) == reference_kvcrush(attentions, agnostic, anchor)


def test_kvcrush_is_not_its_base_or_random_and_frees_memory(setup):
    agnostic = setup[3]

    def kept(spec: str) -> list:
        c = agnostic.clone()
        result = compress(c, get_method(spec), RATIO)
        assert c.kv_bytes() == result.kv_bytes_after and result.fraction_kept == pytest.approx(RATIO, abs=0.01)
        return positions(c)

    crush = kept("kvcrush")
    assert crush != kept("snapkv") and crush != kept("random")
    assert kept("kvcrush:base=h2o:source=accumulated") != kept("h2o")
    assert crush != kept("kvcrush:anchor=mean")  # the anchor orders the dropped rows


def test_kvcrush_compresses_inside_model_generate(smollm2):
    """Through `model.generate` with a Compressor: the same tokens and cache as prefilling, compressing, decoding."""
    from kvmem.generate import decode

    lm, spec = smollm2, "kvcrush:base=h2o:source=accumulated"
    ids = lm.tokenizer("Alice has 3 cats. Bob has 5 dogs. " * 20 + "How many dogs does Bob have? Bob has").input_ids
    cache = KVCache(lm.model.config, compressor=Compressor(get_method(spec), 0.3))
    out = lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
    manual = KVCache(lm.model.config, observe_window=64, track_attention=True)
    logits = feed(lm, manual, ids)
    compress(manual, get_method(spec), 0.3)
    assert decode(lm, manual, logits, 5, stop_at_newline=False) == out
    assert cache.tokens_held() == manual.tokens_held() and cache.kv_bytes() == manual.kv_bytes()

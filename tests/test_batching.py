"""Continuous batching's cache (`kvmem.batch.RowBatch`) and preemption's swap format (`kvmem.store.swap`): rows that
join and leave at any step, each at its own position with its own method, quantization and ragged heads, decode
as they would alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.batch import RowBatch
from kvmem.cache import KVCache
from kvmem.compress import ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed, step
from kvmem.generate import decode, new_cache
from kvmem.prompts import build_prompt
from kvmem.store.chunk import CorruptChunk
from kvmem.store.swap import pack_cache, unpack_cache

# (method, keep ratio, quantization): full, evicted, ragged (adaptive / pyramid budgets), rows standing for several
# tokens (razor), quantized, evicted + quantized, and ragged + quantized (heads decoded onto one row axis)
MIXED = [("full", 1.0, None), ("snapkv", 0.5, None), ("h2o:budget=adaptive", 0.25, None), ("full", 1.0, "kivi-4"),
         ("keydiff:budget=pyramid", 0.25, "kivi-2"), ("streaming-llm:budget=razor", 0.25, None), ("kvzip", 0.5, "kivi-4")]


def prepared(lm, prompt, spec: str, ratio: float, quant: str | None):
    m = get_method(spec)
    cache = new_cache(lm, m, quant)
    feed(lm, cache, prompt.context)
    if ratio < 1:
        compress(cache, m, ratio, context=ModelContext(lm, prompt.context, prompt.head))
    cache.drop_observations()
    return cache, feed(lm, cache, prompt.question)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_rows_that_join_and_leave_decode_as_they_would_alone(name, request):
    """Seven differently compressed and quantized caches of prompts of different lengths join a running batch one
    step apart and leave when done: every row's greedy tokens are those it decodes alone."""
    lm = request.getfixturevalue(name)
    text = open(__file__).read()
    prompts = [build_prompt(lm.tokenizer, text[:900 + 400 * i] + f"\nThe secret word is {w}.", "What is the secret word?")
               for i, w in enumerate(["tangerine", "violet", "copper", "harbour", "lantern", "meadow", "saffron"])]
    n = 12
    alone = []
    for p, spec in zip(prompts, MIXED):
        cache, logits = prepared(lm, p, *spec)
        alone.append(decode(lm, cache, logits, n, stop_at_newline=False))
    rows = [prepared(lm, p, *spec) for p, spec in zip(prompts, MIXED)]
    batch, outs = RowBatch(lm.model.config), [[] for _ in rows]
    for t in range(n + len(rows)):
        if t < len(rows):  # one row joins per step, with the first token of its own prefill
            batch.join(rows[t][0])
            outs[t].append(int(rows[t][1].argmax()))
        for i, (cache, _) in enumerate(rows):
            if len(outs[i]) == n and any(c is cache for c in batch.caches):
                batch.leave(cache)
        if not len(batch):
            break
        order = [next(i for i, (c, _) in enumerate(rows) if c is x) for x in batch.caches]
        logits = step(lm, batch, [[outs[i][-1]] for i in order])
        for row, i in enumerate(order):
            outs[i].append(int(logits[row].argmax()))
    for a, b, spec in zip(alone, outs, MIXED):
        assert b[:len(a)] == a, spec  # `decode` stops at an end token; the batch here decodes n regardless


class Tiny:
    """What `step` needs of a LoadedModel, for a tiny random model."""

    def __init__(self, model):
        self.model, self.name, self.max_context = model, "tiny", 512


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_random_join_and_leave_schedules_never_mix_rows(kind, data, request):
    """Any schedule of joins and leaves: each row's logits in the batch are the logits it gets fed alone (a clone of
    its cache fed the same tokens), so no row reads another's keys, values, positions or mask."""
    model = request.getfixturevalue(kind)
    lm = Tiny(model)
    batch, twins, live = RowBatch(model.config), [], []
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    for _ in range(data.draw(st.integers(3, 8))):
        if not live or data.draw(st.booleans()):  # a new row joins, prefilled to its own length and compressed
            cache = KVCache(model.config, observe_window=8)
            feed(lm, cache, torch.randint(0, 128, (data.draw(st.integers(4, 40)),), generator=gen).tolist())
            spec = data.draw(st.sampled_from(["full", "knorm", "knorm:budget=adaptive", "streaming-llm"]))
            if spec != "full":
                compress(cache, get_method(spec), data.draw(st.sampled_from([0.75, 0.5, 0.25])))
            cache.drop_observations()
            batch.join(cache)
            live.append(cache)
            twins.append(cache.clone())
        if len(live) > 1 and data.draw(st.booleans()):  # one leaves
            gone = data.draw(st.integers(0, len(live) - 1))
            batch.leave(live.pop(gone))
            twins.pop(gone)
        q = data.draw(st.integers(1, 3))  # a step may feed several tokens per row (a question)
        tokens = [torch.randint(0, 128, (q,), generator=gen).tolist() for _ in live]
        together = step(lm, batch, tokens)
        for row, (twin, ids) in enumerate(zip(twins, tokens)):
            torch.testing.assert_close(together[row], feed(lm, twin, ids), rtol=1e-4, atol=1e-5)
        assert batch.next_positions() == [t.get_seq_length() for t in twins]


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_a_batch_decodes_uncompressed_rows_in_the_kernel_and_alone_keeps_sdpa(kind, request, monkeypatch):
    """In a RowBatch a decode step's uncompressed float32 rows are attended by the kernel, one call per layer for
    every row (not an SDPA call per row); a sequence decoded alone keeps transformers' SDPA (bit-identity). The
    logits agree."""
    from kvmem import kernel

    model = request.getfixturevalue(kind)
    lm, gen = Tiny(model), torch.Generator().manual_seed(0)
    caches = []
    for n in (5, 23, 40):  # Gemma's sliding layers (window 8) hold their last 7 tokens
        caches.append(KVCache(model.config, observe_window=0))
        feed(lm, caches[-1], torch.randint(0, 128, (n,), generator=gen).tolist())
    twins = [c.clone() for c in caches]
    calls, in_place = [], kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda query, rows, scaling: calls.append(len(rows)) or
                        in_place(query, rows, scaling))
    together = step(lm, RowBatch(model.config, caches), [[7]] * 3)
    assert calls == [3] * model.config.num_hidden_layers
    calls.clear()
    alone = torch.stack([feed(lm, twin, [7]) for twin in twins])
    assert calls == []
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_batch_refuses_what_it_cannot_hold(tiny_llama, tiny_gemma):
    lm = Tiny(tiny_llama)
    batch = RowBatch(tiny_llama.config)
    with pytest.raises(KVMemError, match="empty cache"):
        batch.join(KVCache(tiny_llama.config))
    with pytest.raises(KVMemError, match="only a kvmem KVCache of this model"):
        batch.join(KVCache(tiny_gemma.config))
    cache = KVCache(tiny_llama.config)
    feed(lm, cache, [1, 2, 3])
    batch.join(cache)
    with pytest.raises(KVMemError, match="already a row"):
        batch.join(cache)
    with pytest.raises(KVMemError, match="same number of tokens"):
        step(lm, batch, [[]])
    with pytest.raises(KVMemError, match="rows of tokens"):
        step(lm, batch, [[1], [2]])
    batch.leave(cache)
    with pytest.raises(KVMemError, match="not a row"):
        batch.leave(cache)


@pytest.mark.parametrize("spec,ratio,quant", [("full", 1.0, None), ("h2o:budget=adaptive", 0.25, None),
                                              ("streaming-llm:budget=razor", 0.25, None), ("full", 1.0, "kivi-2"),
                                              ("knorm", 0.5, "kvquant-3")])
def test_a_swapped_cache_comes_back_bit_for_bit(smollm2, spec, ratio, quant):
    """Preemption's swap: the rows as held (quantized ones still encoded), positions and weights come back exactly,
    and decoding goes on with the same logits; a damaged blob or another model's is refused by name."""
    lm = smollm2
    p = build_prompt(lm.tokenizer, open(__file__).read()[:1500], "What does this test?")
    cache, _ = prepared(lm, p, spec, ratio, quant)
    blob = pack_cache(cache, lm.fingerprint)
    back = unpack_cache(blob, new_cache(lm, get_method(spec), quant), lm.fingerprint)
    back.drop_observations()
    assert back.tokens_held() == cache.tokens_held()
    assert back.kv_bytes() <= cache.kv_bytes()  # exactly sized: the spare rows a growing buffer keeps are not swapped
    for a, b in zip(cache.layers, back.layers):
        assert a.next_position == b.next_position and a.compressed == b.compressed
        for x, y in zip(a.rows.heads(), b.rows.heads()):
            assert all(torch.equal(u, v) for u, v in zip(x, y))
    assert torch.equal(feed(lm, cache, [42]), feed(lm, back, [42]))
    damaged = bytearray(blob)
    damaged[-100] ^= 1
    with pytest.raises(CorruptChunk, match="checksum"):
        unpack_cache(bytes(damaged), new_cache(lm, get_method(spec), quant), lm.fingerprint)
    with pytest.raises(KVMemError, match="for model"):
        unpack_cache(blob, new_cache(lm, get_method(spec), quant), "0" * 64)


def test_a_swapped_decode_phase_row_resumes_evicting_as_before(smollm2):
    """A moment-kv row swapped out mid-decoding takes its momentum and prompt end along: resumed, it holds the same
    rows and evicts the same ones at the next steps as the row that never left."""
    from kvmem.compress import compress_while_decoding

    lm, spec = smollm2, "moment-kv:decode_budget=3"
    p = build_prompt(lm.tokenizer, open(__file__).read()[:800], "What does this test?")
    cache = new_cache(lm, get_method(spec))
    feed(lm, cache, p.ids)
    compress_while_decoding(cache, get_method(spec), 1.0)
    for t in (11, 12, 13, 14, 15):
        feed(lm, cache, [t])
    back = unpack_cache(pack_cache(cache, lm.fingerprint), new_cache(lm, get_method(spec)), lm.fingerprint)
    assert back.layers[0].observation.prompt_end == len(p.ids)
    compress_while_decoding(back, get_method(spec), 1.0, back.layers[0].observation.prompt_end)
    for t in (16, 17, 18):
        assert torch.equal(feed(lm, cache, [t]), feed(lm, back, [t]))
        assert [a.tolist() for a in cache.layers[5].head_positions] == [b.tolist() for b in back.layers[5].head_positions]
    assert cache.tokens_held() == back.tokens_held() == [[len(p.ids) + 3] * 3] * len(cache.layers)


def test_a_damaged_swap_file_fails_its_request_only(smollm2):
    """A preempted row whose swapped KV fails verification is not decoded from it: its request gets an error, and
    the scheduler goes on with the others."""
    from kvmem.serve.engine import Job, Options, Sampling, Stream
    from kvmem.serve.scheduler import Request, Row, Scheduler

    lm = smollm2
    scheduler = Scheduler(lm, kv_budget=2**30)
    scheduler._stopped = True  # this test drives the scheduler's steps itself: its thread stops first
    with scheduler._wake:
        scheduler._wake.notify()
    scheduler._thread.join()
    try:
        p = build_prompt(lm.tokenizer, "The door is red.", "What colour is the door?")
        events: list = []
        job = Job(p, Sampling(8, temperature=0), Options())
        request = Request(job, events.append, 1)
        scheduler.requests[job] = request
        cache, logits = prepared(lm, p, "full", 1.0, None)
        row = Row(job, Stream(lm, job, 0, events.append, 8, set()), cache, 0, 0, 0)
        row.stream.push(logits)
        scheduler.batch.join(cache)
        scheduler.rows.append(row)
        scheduler._swap_out(row)
        path = scheduler._swap._path(row.swapped)
        blob = bytearray(path.read_bytes())
        blob[-10] ^= 1
        path.write_bytes(bytes(blob))
        scheduler._resume()
        assert not scheduler.rows and not scheduler.swapped and job not in scheduler.requests
        assert events[-1].kind == "error" and "could not resume" in events[-1].data["message"]
    finally:
        scheduler.close()

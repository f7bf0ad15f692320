"""Layer-wise pipelining of a prefix load (reuse/pipeline.py) on the real models: the forward starts while later
layers are still being verified and put in place, the result is bit for bit the sequential load's and the cold
prefill's, and a layer that fails verification mid-forward is recomputed, never read."""

from __future__ import annotations

import json
import threading
import time
import warnings

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.calibration import load_abstracts
from kvmem.prompts import build_prompt
from kvmem.reuse import pipeline, prefill
from kvmem.store import ChunkStore, StoreWarning, chunk
from kvmem.store.store import Opened

DOC = " ".join(load_abstracts()[:5])[:2500] + " The vault code of the Orion lab is 4471."
QUESTION = "What is the vault code of the Orion lab?"


def _warm(lm, store, prompt, **kw):
    cache = KVCache(lm.model.config)
    logits, report = prefill(lm, cache, prompt.ids, store, context_end=len(prompt.context), **kw)
    return logits, report, cache


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_overlapped_load_is_the_sequential_load_and_the_cold_prefill(model, request):
    lm = request.getfixturevalue(model)
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    store = ChunkStore("memory", chunk_size=128)
    cold, _, cold_cache = _warm(lm, store, prompt)
    seq, seq_report, seq_cache = _warm(lm, store, prompt, overlap=False)
    over, report, cache = _warm(lm, store, prompt)
    assert report.reused_tokens == seq_report.reused_tokens == len(prompt.context) and report.chunks_loaded > 2
    assert torch.equal(cold, over) and torch.equal(seq, over)
    for a, b, c in zip(cold_cache.layers, seq_cache.layers, cache.layers):  # sliding layers (Gemma) included
        for (ka, va, pa), (kb, vb, pb), (kc, vc, pc) in zip(a.rows.heads(), b.rows.heads(), c.rows.heads()):
            assert torch.equal(ka, kc) and torch.equal(va, vc) and torch.equal(pa, pc)
            assert torch.equal(kb, kc) and torch.equal(vb, vc) and torch.equal(pb, pc)
    assert all(layer.arrival is None for layer in cache.layers)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_forward_runs_layer_0_while_the_last_layer_is_still_loading(smollm2, monkeypatch, overlap):
    """The last layer's rows are made slow to verify; with overlap the forward's first layer runs before they are in
    place (and the forward waits for them at the last layer); without, after."""
    lm = smollm2
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    store = ChunkStore("memory", chunk_size=128)
    _warm(lm, store, prompt)
    last = lm.model.config.num_hidden_layers - 1
    when: dict[str, float] = {}
    layer_of, import_layer = Opened.layer, pipeline.import_layer

    def slow_layer(self, l):
        if l == last:
            time.sleep(0.1)  # per chunk: the last layer comes ~0.5 s after the others
        return layer_of(self, l)

    def timed_import(layer, *args):
        import_layer(layer, *args)
        if layer.layer_idx == last:
            when["last layer in place"] = time.perf_counter()

    monkeypatch.setattr(Opened, "layer", slow_layer)
    monkeypatch.setattr(pipeline, "import_layer", timed_import)
    cache = KVCache(lm.model.config)
    first = cache.layers[0]
    update = first.update

    def timed_update(*args, **kwargs):
        when.setdefault("layer 0 runs", time.perf_counter())
        return update(*args, **kwargs)

    first.update = timed_update
    _, report = prefill(lm, cache, prompt.ids, store, context_end=len(prompt.context), overlap=overlap)
    assert report.reused_tokens == len(prompt.context)
    if overlap:
        assert when["layer 0 runs"] < when["last layer in place"] and report.wait_s > 0.05
    else:
        assert when["layer 0 runs"] > when["last layer in place"]


def _altered(blob: bytes, tensor: str) -> bytes:
    """`blob` with one byte of `tensor`'s data flipped (its header and the other layers untouched)."""
    payload = blob[chunk.HEADER:]
    n = int.from_bytes(payload[:8], "little")
    a, _ = json.loads(payload[8:8 + n])[tensor]["data_offsets"]
    out = bytearray(blob)
    out[chunk.HEADER + 8 + n + a + 3] ^= 0x40
    return bytes(out)


def test_a_layer_that_fails_verification_mid_forward_is_recomputed_not_read(smollm2):
    """Chunk 2's last layer is altered after the forward has started on the loaded layers: the forward stops before
    it reads that layer, the chunk is discarded, and the prefill starts again from the two good chunks: the logits
    are the cold prefill's, bit for bit."""
    lm = smollm2
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    store = ChunkStore("memory", chunk_size=128)
    cold, _, _ = _warm(lm, store, prompt)
    tier, key = store.tiers[0], store.keys(lm, prompt.ids)[2]
    last = lm.model.config.num_hidden_layers - 1
    tier.put(key, _altered(tier.get(key), f"{last}.values"))
    assert chunk.open_frame(tier.get(key)).header["key"] == key  # the header still verifies: only the layer is wrong
    with pytest.warns(StoreWarning, match=rf"{key[:12]}.*tensors {last}\.\*"):
        logits, report, cache = _warm(lm, store, prompt)
    assert report.failed_loads == 1 and report.reused_tokens == 2 * 128 and store.stats["corrupt"] == 1
    assert tier.get(key) is not None  # recomputed and stored again, verified
    chunk.unpack(tier.get(key))
    assert torch.equal(logits, cold)


def test_a_cancelled_prefill_stops_its_loader(smollm2):
    lm = smollm2
    prompt = build_prompt(lm.tokenizer, DOC, QUESTION)
    store = ChunkStore("memory", chunk_size=128)
    _warm(lm, store, prompt)

    class Cancelled(Exception):
        pass

    def interrupt():
        raise Cancelled

    cache = KVCache(lm.model.config)
    with pytest.raises(Cancelled):
        prefill(lm, cache, prompt.ids, store, context_end=len(prompt.context), interrupt=interrupt)
    assert all(layer.arrival is None for layer in cache.layers)
    assert not [t for t in threading.enumerate() if t.name == "kvmem-layers"]
    held = [layer.is_initialized for layer in cache.layers]
    time.sleep(0.3)  # the loader stopped when prefill returned: nothing is put into the cache after
    assert [layer.is_initialized for layer in cache.layers] == held


def test_a_sliding_layer_reads_only_the_chunks_in_its_window(gemma3):
    """Gemma-3's sliding layers keep the last 511 rows: their rows of earlier chunks are never read, so an altered
    byte there goes unread (the load is whole and bit-identical to cold), while the same chunk's global layer is still
    verified (an altered byte there is refused)."""
    lm = gemma3
    prompt = build_prompt(lm.tokenizer, " ".join(load_abstracts()[:12]), QUESTION)
    store = ChunkStore("memory", chunk_size=128)
    cold, _, _ = _warm(lm, store, prompt)
    assert len(prompt.context) > lm.model.config.sliding_window + 3 * 128
    types = lm.model.config.layer_types
    sliding, full = types.index("sliding_attention"), types.index("full_attention")
    tier, key = store.tiers[0], store.keys(lm, prompt.ids)[0]
    stored = tier.get(key)
    tier.put(key, _altered(stored, f"{sliding}.values"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits, report, _ = _warm(lm, store, prompt)
    assert not [w for w in seen if issubclass(w.category, StoreWarning)]
    assert report.failed_loads == 0 and report.reused_tokens == len(prompt.context) and store.stats["corrupt"] == 0
    assert torch.equal(logits, cold)
    tier.put(key, _altered(stored, f"{full}.values"))
    with pytest.warns(StoreWarning, match=rf"tensors {full}\.\*"):
        logits, report, _ = _warm(lm, store, prompt)
    assert report.failed_loads == 1 and report.reused_tokens == 0 and torch.equal(logits, cold)

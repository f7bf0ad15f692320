"""The stored chunk's per-layer layouts (issue 36's load path): raw chunks (codec version 2) keep a layer's heads as
(H, T, D) tensors, decoded as `DenseExport` and checked without per-head objects; the quant codec (version 2) keeps a
KIVI layer's codes stacked (`QuantizedRows.export_layer` / `import_layer`), decoded in one pass. Chunks of the first
versions are refused by name; damaged stacked codes are refused by name and recomputed; a prefix loaded from pieces
put in place as they arrive equals the cold prefill, also when a piece is missing."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.quant import QuantizedRows, get_scheme
from kvmem.reuse import prefill
from kvmem.rows import DenseExport
from kvmem.store import ChunkStore, StoreWarning, chunk
from kvmem.store.tiers import MemoryTier
from test_store import IDS, run, tiny_lm

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm()


def test_raw_chunks_decode_as_dense_layers_without_per_head_objects(lm):
    store = ChunkStore("memory", chunk_size=16)
    _, _, cache = run(lm, store)
    got = store.load(lm, store.keys(lm, IDS)[1], 16, 16, views=True)
    assert got is not None and all(isinstance(rows, DenseExport) for rows in got.layers)
    assert all(rows._heads is None for rows in got.layers)  # checked as three tensors a layer, no head made
    for rows, layer in zip(got.layers, cache.layers):  # the heads, when asked for, are the rows the cache computed
        for head, (k, v, p) in zip(rows.heads, layer.rows.heads()):
            assert torch.equal(head["keys"], k[16:32]) and torch.equal(head["values"], v[16:32])
            assert torch.equal(head["positions"], p[16:32])


def test_a_chunk_of_the_first_raw_format_is_refused_by_name(lm):
    """A chunk written head by head under codec version 1 (what kvmem wrote before) is never decoded: its header names
    another codec version, the read is a miss that is recomputed, and the chunk is stored again in the new layout."""
    reference, _, _ = run(lm, None)
    store = ChunkStore("memory", chunk_size=16)
    run(lm, store)
    key = store.keys(lm, IDS)[0]
    tensors, header = chunk.unpack(store.tiers[0].get(key))
    old = {f"{l}.{h}.{f}": tensors[f"{l}.{f}"][h].clone() for l in range(len(header["codec_meta"]["heads"]))
           for h in range(header["codec_meta"]["heads"][l]) for f in ("keys", "values", "positions")}
    meta = {k: v for k, v in header["codec_meta"].items() if k != "dense"}
    store.tiers[0].put(key, chunk.pack(old, header | {"codec_version": 1, "codec_meta": meta}))
    with pytest.warns(StoreWarning, match="codec_version is 1, expected 2"):
        logits, report, _ = run(lm, store)
    assert report.reused_tokens == 0 and torch.allclose(logits, reference, atol=1e-5)
    assert isinstance(store.load(lm, key, 0, 16).layers[0], DenseExport)  # written again, as version 2


def test_stacked_quantized_layers_equal_the_per_head_decode(lm):
    """A KIVI layer exported as one set of tensors and imported back holds the same codes and decodes to the same rows
    as the per-head export; the store's quant codec (version 2) uses it and reuses a prefix as before."""
    scheme = get_scheme("kivi-4:group=16")
    scheme.residual = 8  # 40 rows encoded, 8 held in full precision (as a cache holds them; the store's codec keeps 0)
    torch.manual_seed(0)
    keys, values = torch.randn(2, 48, 16), torch.randn(2, 48, 16)
    positions = torch.arange(48, dtype=torch.int32).expand(2, 48)
    held = QuantizedRows.of(scheme, list(keys), list(values), list(positions))
    tensors, meta = held.export_layer()
    back = QuantizedRows.import_layer(scheme, tensors, meta)
    per_head = QuantizedRows.import_encoded(scheme, held.export_rows())
    for (k1, v1, p1), (k2, v2, p2) in zip(back.heads(), per_head.heads()):
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(p1, p2)
    k, v, p = back.stacked()
    assert torch.equal(k, torch.stack([h[0] for h in per_head.heads()])) and torch.equal(p, positions)
    ragged = QuantizedRows.of(scheme, [keys[0], keys[1, :32]], [values[0], values[1, :32]],
                              [positions[0], positions[1, :32]])
    assert ragged.export_layer() is None  # heads of different lengths: exported head by head

    store = ChunkStore("memory", codec="quant:kivi-4:group=16", chunk_size=16)
    run(lm, store)
    got = store.load(lm, store.keys(lm, IDS)[0], 0, 16)
    assert all(isinstance(rows, DenseExport) for rows in got.layers)
    _, header = chunk.unpack(store.tiers[0].get(store.keys(lm, IDS)[0]))
    assert {layer["layout"] for layer in header["codec_meta"]["layers"]} == {"layer"}
    assert header["codec_version"] == 2


@pytest.mark.parametrize("lie", ["packed shape", "scale dtype", "positions", "codec", "format"])
def test_stacked_codes_that_lie_are_refused_by_name(lie):
    scheme = get_scheme("kivi-2:group=16")
    scheme.residual = 0
    torch.manual_seed(1)
    held = QuantizedRows.of(scheme, list(torch.randn(2, 32, 16)), list(torch.randn(2, 32, 16)),
                            list(torch.arange(32, dtype=torch.int32).expand(2, 32)))
    tensors, meta = held.export_layer()
    if lie == "packed shape":
        tensors["k.packed"] = tensors["k.packed"][:, :, :-1].clone()
        match = "packed codes"
    elif lie == "scale dtype":
        tensors["v.scale"] = tensors["v.scale"].float()
        match = "scales"
    elif lie == "positions":
        tensors["positions"] = tensors["positions"].flip(1).contiguous()
        match = "increasing"
    elif lie == "codec":
        meta = meta | {"codec": "kivi-4"}
        match = "encoded as 'kivi-4'"
    else:
        meta = meta | {"format": 1}
        match = "unknown format"
    with pytest.raises(KVMemError, match=match):
        QuantizedRows.import_layer(scheme, tensors, meta)


def test_a_stored_layer_of_damaged_codes_is_discarded_and_recomputed(lm):
    ref_store = ChunkStore("memory", codec="quant:kivi-4:group=16", chunk_size=16)
    run(lm, ref_store)
    ref_store.tiers[0].delete(ref_store.keys(lm, IDS)[1])
    reference, _, _ = run(lm, ref_store)  # chunk 0 decoded, the rest computed
    store = ChunkStore("memory", codec="quant:kivi-4:group=16", chunk_size=16)
    run(lm, store)
    key = store.keys(lm, IDS)[1]
    tensors, header = chunk.unpack(store.tiers[0].get(key))
    tensors["0.k.packed"] = tensors["0.k.packed"][..., :-1].clone()  # a writer's bug: the checksum matches
    store.tiers[0].put(key, chunk.pack(tensors, header))
    with pytest.warns(StoreWarning, match="packed codes"):
        logits, report, _ = run(lm, store)
    assert report.reused_tokens == 16 and store.stats["corrupt"] == 1  # chunk 0 only; chunk 1 was recomputed
    assert torch.equal(logits, reference)


def test_a_prefix_put_in_place_piece_by_piece_equals_the_cold_prefill(lm):
    """Pieces are copied into the layers' buffers as they arrive; a missing piece stops the run and what came is
    imported afresh (exact buffers), bit-identical with the raw codec either way, and the buffers are adopted whole."""
    cold, _, _ = run(lm, None)
    store = ChunkStore([MemoryTier()], chunk_size=16)
    run(lm, store)
    warm, report, cache = run(lm, store)
    assert report.reused_tokens == 80 and torch.equal(warm, cold)
    layer = cache.layers[0]
    assert layer.rows.k.shape[1] >= 90  # one buffer held the 80 loaded rows and the 10 computed after them
    store.tiers[0].delete(store.keys(lm, IDS)[3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a miss is not a failure
        again, report, _ = run(lm, store)
    assert report.reused_tokens == 48 and torch.equal(again, cold)


def test_a_sliding_model_loads_its_windows_from_dense_chunks():
    gemma = tiny_lm("gemma")
    cold_cache = KVCache(gemma.model.config)
    store = ChunkStore("memory", chunk_size=16)
    cold, _ = prefill(gemma, cold_cache, IDS, store)  # computed in the same pieces, and stored
    cache = KVCache(gemma.model.config)
    warm, report = prefill(gemma, cache, IDS, store)
    assert report.reused_tokens == 80 and torch.equal(warm, cold)
    for a, b in zip(cache.layers, cold_cache.layers):
        assert [p.tolist() for p in a.head_positions] == [p.tolist() for p in b.head_positions]

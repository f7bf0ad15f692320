"""The CacheGen chunk codec: the entropy coding is lossless (decode gives exactly the quantizer's
reconstruction), errors stay within half a bin, ragged/empty heads and positions survive, deltas are taken
against anchor tokens, it beats kivi-8's bytes on correlated KV, and bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.compress import compress, get_method
from kvmem.errors import KVMemError
from kvmem.rows import ExportedRows
from kvmem.store.cachegen import CacheGenCodec, _quantize
from kvmem.store.codecs import QuantCodec, get_codec

torch.set_num_threads(1)


def head(t: int, d: int = 16, seed: int = 0, dtype=torch.float32, positions=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    offset = torch.randn(d, generator=g) * 3  # channel means, as keys' outlier channels have
    keys = offset + torch.randn(t, d, generator=g).cumsum(0) * 0.3 + torch.randn(t, d, generator=g) * 0.1
    values = torch.randn(t, d, generator=g) * torch.rand(d, generator=g) * 2
    if t > 3:  # a sink-like token and a spike: anchors and deltas beyond the alphabet (escapes)
        keys[0] *= 40
        values[3, 1] = 500.0
    p = torch.arange(t, dtype=torch.int32) if positions is None else positions
    return {"keys": keys.to(dtype), "values": values.to(dtype), "positions": p}


def ragged_layers(dtype=torch.float32) -> list[ExportedRows]:
    evicted = torch.tensor([0, 2, 3, 7, 8, 9, 15, 40, 41, 60, 61, 62, 100], dtype=torch.int32)
    return [ExportedRows([head(57, seed=1, dtype=dtype), head(0, seed=2, dtype=dtype), head(1, seed=3, dtype=dtype)]),
            ExportedRows([head(13, seed=4, dtype=dtype, positions=evicted)]),
            ExportedRows([head(10, seed=5, dtype=dtype),
                          head(11, seed=6, dtype=dtype, positions=torch.arange(50, 61, dtype=torch.int32))]),
            ExportedRows([])]


def size(tensors: dict, meta: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values()) + len(json.dumps(meta))


@pytest.mark.parametrize("spec", ["cachegen", "cachegen:key_bins=1+2+3:value_bins=0.05:group=3:clip=2",
                                  "cachegen:group=1", "cachegen:group=100:anchor_bin=0.5", "cachegen:delta=none:value_bins=1",
                                  "cachegen:delta=none:sink=9:key_bins=0.5:value_bins=1.5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_exactly_the_quantizers_reconstruction(spec, dtype):
    codec, layers = get_codec(spec), ragged_layers(dtype)
    tensors, meta = codec.encode(layers)
    json.dumps(meta)  # the meta is JSON
    assert all(t.dtype in (torch.uint8, torch.int16, torch.int32, torch.float16, torch.float32) for t in tensors.values())
    assert sum(tensors[f"{l}.escapes"].numel() for l in range(len(layers))) > 0  # the escape path is exercised
    decoded, expected = codec.decode(tensors, meta), codec.reconstruct(layers)
    assert len(decoded) == len(layers)
    for got, want, orig in zip(decoded, expected, layers):
        assert len(got.heads) == len(orig.heads)
        for g, w, o in zip(got.heads, want.heads, orig.heads):
            assert set(g) == {"keys", "values", "positions"}
            assert torch.equal(g["keys"], w["keys"]) and torch.equal(g["values"], w["values"])  # bit for bit
            assert g["keys"].dtype == dtype and g["keys"].shape == o["keys"].shape and g["values"].shape == o["values"].shape
            assert g["positions"].dtype == torch.int32 and torch.equal(g["positions"], o["positions"])


@pytest.mark.parametrize("spec", ["cachegen", "cachegen:key_bins=0.1:value_bins=1:anchor_bin=0.01", "cachegen:group=4:clip=1",
                                  "cachegen:delta=none:key_bins=0.3:value_bins=0.7", "cachegen:delta=none:sink=4:value_bins=2"])
def test_error_is_at_most_half_a_bin_of_the_channel_std(spec):
    codec, layers = get_codec(spec), ragged_layers()
    decoded = codec.decode(*codec.encode(layers))
    for l, (rows, dec) in enumerate(zip(layers, decoded)):
        bins = codec.layer_bins(l, len(layers))
        for h, (o, d) in enumerate(zip(rows.heads, dec.heads)):
            for i, field in enumerate(("keys", "values")):
                scale, _, _ = _quantize(o[field], codec.group, codec.anchor_bin, bins[i])
                bound = max(bins[i], codec.anchor_bin) / 2 * scale[1].float() * 1.001 + 1e-5 * o[field].abs()
                assert ((d[field] - o[field]).abs() <= bound).all(), (spec, l, h, field)


def test_deltas_are_taken_against_the_groups_anchor():
    ramp = torch.arange(30.0)[:, None].repeat(1, 4)  # rises by one a token: deltas to the anchor grow within a group
    scale, qa, qd = _quantize(ramp, group=10, anchor_bin=0.001, bin=0.001)
    assert qa.shape == (3, 4) and qd.shape == (27, 4)
    step = 1 / (scale[1].float() * 0.001)  # one token's rise in bins
    within = torch.arange(1, 10, dtype=torch.float32).repeat(3)[:, None]  # a token's distance to its anchor
    assert ((qd - within * step).abs() <= 2).all()  # to the previous token, every delta would be one step


def test_without_deltas_tokens_are_coded_as_themselves_at_the_same_reconstruction_as_coarse_anchors():
    """delta=none: no anchors; every token is its own symbol at the layer's bin, which is exactly what closed-loop
    deltas give when the anchors are as coarse as the deltas (anchor and delta land on the same grid)."""
    layers = ragged_layers()
    plain = get_codec("cachegen:delta=none:key_bins=0.5:value_bins=0.5")
    anchored = get_codec("cachegen:key_bins=0.5:value_bins=0.5:anchor_bin=0.5")
    assert plain.spec == "cachegen:delta=none:key_bins=0.5+0.5+0.5:value_bins=0.5+0.5+0.5"
    scale, qa, qd = _quantize(layers[0].heads[0]["keys"], plain.coded_group, plain.anchor_bin, 0.5)
    assert qa.shape == (0, 16) and qd.shape == (57, 16)
    for a, b in zip(plain.decode(*plain.encode(layers)), anchored.reconstruct(layers)):
        for x, y in zip(a.heads, b.heads):
            assert torch.allclose(x["keys"], y["keys"], atol=1e-5) and torch.allclose(x["values"], y["values"], atol=1e-5)


def test_sink_positions_are_coded_at_the_fine_bin_wherever_they_sit():
    """delta=none:sink=N: rows at positions < N (found by position, so evicted or stored positions work too) get
    anchor_bin's error bound, the rest their layer's bin; a chunk claiming a bad sink is refused."""
    codec = get_codec("cachegen:delta=none:sink=9:anchor_bin=0.01:key_bins=2:value_bins=2")
    layers = ragged_layers()
    tensors, meta = codec.encode(layers)
    decoded = codec.decode(tensors, meta)
    fine_rows = 0
    for rows, dec in zip(layers, decoded):
        for o, d in zip(rows.heads, dec.heads):
            fine = o["positions"] < 9
            fine_rows += int(fine.sum())
            for field in ("keys", "values"):
                scale, _, _ = _quantize(o[field], 0, 0.01, 2.0)
                err = (d[field] - o[field]).abs() / scale[1].float()
                assert (err[fine] <= 0.005 * 1.01 + 1e-4).all() and (err[~fine] <= 1.0 * 1.01).all()
    assert fine_rows == 9 + 1 + 5 + 9  # head 0 of layer 0, the one-row head, layer 1's evicted positions, layer 2 head 0
    with pytest.raises(KVMemError, match="sink"):
        codec.decode(tensors, {**meta, "sink": -2})


def test_correlated_tokens_compress_better_than_the_same_tokens_shuffled():
    g = torch.Generator().manual_seed(0)
    freq, phase = torch.rand(32, generator=g) * 2 + 0.5, torch.rand(32, generator=g) * 6.3  # slowly varying channels
    walk = torch.sin(torch.arange(400.0)[:, None] / 400 * 6.3 * freq + phase) + torch.randn(400, 32, generator=g) * 0.01
    perm = torch.randperm(400, generator=g)
    codec = get_codec("cachegen")
    positions = torch.arange(400, dtype=torch.int32)
    rows = lambda k, v: [ExportedRows([{"keys": k, "values": v, "positions": positions}])]  # noqa: E731
    smooth = size(*codec.encode(rows(walk, walk.flip(1))))
    shuffled = size(*codec.encode(rows(walk[perm], walk.flip(1)[perm])))
    assert smooth < 0.5 * shuffled  # same per-channel values and stds: only the deltas to anchors tell them apart


def test_fewer_bytes_than_kivi8_on_correlated_kv():
    layers = [ExportedRows([head(256, d=32, seed=10 * l + h) for h in range(2)]) for l in range(3)]
    cachegen, kivi8 = size(*get_codec("cachegen").encode(layers)), size(*QuantCodec("kivi-8").encode(layers))
    assert cachegen < 0.6 * kivi8


def test_a_compressed_tiny_model_cache_round_trips(tiny_llama):
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = KVCache(tiny_llama.config, observe_window=32)
    with torch.no_grad():
        tiny_llama(input_ids=ids, cache=cache, use_cache=True)
    compress(cache, get_method("snapkv", budget="adaptive"), 0.5)  # ragged heads, evicted positions
    rows = [layer.export_rows() for layer in cache.layers]
    decoded = get_codec("cachegen").decode(*get_codec("cachegen").encode(rows))
    target = KVCache(tiny_llama.config)
    for layer, r in zip(target.layers, decoded):
        layer.import_rows(r, next_position=60)
    assert target.tokens_held() == cache.tokens_held()
    new = torch.tensor([[5, 7]])
    with torch.no_grad():
        got = tiny_llama(input_ids=new, cache=target, use_cache=True).logits
        want = tiny_llama(input_ids=new, cache=cache, use_cache=True).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_spec_is_canonical():
    assert get_codec("cachegen").spec == "cachegen" and CacheGenCodec().version == 1
    spec = get_codec("cachegen:key_bins=0.5:group=20").spec
    assert spec == "cachegen:group=20:key_bins=0.5+0.5+0.5"
    assert get_codec(spec).spec == spec


@pytest.mark.parametrize("spec, word", [("cachegen:bins=3", "bins"), ("cachegen:group=x", "group"),
                                        ("cachegen:key_bins=0.1+0.2", "key_bins"), ("cachegen:value_bins=-1", "value_bins"),
                                        ("cachegen:group=0", "group"), ("cachegen:clip", "clip"),
                                        ("cachegen:delta=prev", "delta"), ("cachegen:delta=none:group=5", "delta=none"),
                                        ("cachegen:delta=none:anchor_bin=0.1", "sink"), ("cachegen:sink=4", "sink"),
                                        ("cachegen:delta=none:sink=-1", "sink"), ("cachegen:delta=none:sink=x", "sink")])
def test_bad_options_are_refused(spec, word):
    with pytest.raises(KVMemError, match=word):
        get_codec(spec)


def test_rows_with_log_weights_are_refused():
    rows = ExportedRows([{**head(5), "log_weights": torch.zeros(5)}])
    with pytest.raises(KVMemError, match="log-weights"):
        get_codec("cachegen").encode([rows])

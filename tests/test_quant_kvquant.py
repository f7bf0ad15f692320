"""KVQuant (pre-RoPE keys, fitted non-uniform datatypes, dense-and-sparse outliers, exact sinks) and KV-AdaQuant
(more bits for keys than values), on real SmolLM2 keys and values held out from calibration."""

from __future__ import annotations

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.calibration import calibration_ids
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer
from kvmem.quant import get_scheme
from kvmem.quant.adaquant import AdaQuant
from kvmem.rope import move, rope_frequencies, unrotate


@pytest.fixture(scope="module")
def kvquant3(smollm2):
    return get_scheme("kvquant-3", smollm2)  # fitted once per model fingerprint, cached with the artefacts


@pytest.fixture(scope="module")
def held_out(smollm2):
    """Per layer and KV head (keys, values, positions) of 256 tokens that no calibration reads (tokens 2816-3071)."""
    ids = calibration_ids(smollm2.tokenizer, 12, 256)[11]
    cache = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, cache, ids)
    return [layer.rows.heads() for layer in cache.layers]


def roundtrip(scheme, layer: int, head: int, k, v, p):
    view = scheme.for_layer(layer)
    ek, ev = view.encode(k, v, p, head)
    return ek, ev, *view.decode(ek, ev, p, head)


def test_outliers_and_sinks_are_held_exactly_and_the_rest_is_coded(kvquant3, held_out, smollm2):
    k, v, p = held_out[7][1]  # positions 0..255
    ek, ev, keys, values = roundtrip(kvquant3, 7, 1, k, v, p)
    # the attention sink (position 0) is held exactly, keys and values
    assert ek.exact_rows.tolist() == ev.exact_rows.tolist() == [0]
    assert torch.equal(keys[0], k[0]) and torch.equal(values[0], v[0])
    # values: the largest 1 % of each other row's magnitudes (one of 64) are sparse, exact to float16
    assert torch.equal(ev.out_rows, torch.arange(1, len(p), dtype=torch.int32))
    rows, cols = ev.out_rows.long(), ev.out_cols.long()
    assert torch.equal(cols, v[1:].abs().argmax(-1)) and torch.allclose(values[rows, cols], v[rows, cols], rtol=1e-3)
    # keys: thresholds per channel fitted offline, so about 1 % of held-out elements fall outside them
    assert 0.002 < ek.out_vals.numel() / k.numel() < 0.05
    # exact where they are coded: before RoPE (rotation mixes an outlier with its quantized channel pair)
    inv_freq = rope_frequencies(smollm2.model, 7)
    r, c = ek.out_rows.long(), ek.out_cols.long()
    assert torch.allclose(unrotate(keys, p, inv_freq)[r, c], unrotate(k, p, inv_freq)[r, c], rtol=1e-3, atol=1e-4)
    assert (keys - k).abs().max() > 1e-3 and (values - v).abs().max() > 1e-3  # the rest really is quantized
    later = p + 100  # the same rows further on: no sink among them
    moved = move(k, p, later, rope_frequencies(smollm2.model, 7))
    assert roundtrip(kvquant3, 7, 1, moved, v, later)[0].exact_rows.numel() == 0


def test_the_datatype_is_fitted_and_not_uniform(kvquant3):
    for layer in (0, 15, 29):
        for kind in ("key_levels", "value_levels"):
            levels = kvquant3.fitted[f"{layer}.{kind}"]
            assert levels.shape == (8,) and torch.all(levels[1:] > levels[:-1]) and levels.abs().max() <= 1
            assert (levels - torch.linspace(-1, 1, 8)).abs().max() > 0.05  # not the uniform grid
    assert not torch.equal(kvquant3.fitted["0.key_levels"], kvquant3.fitted["15.key_levels"])  # per layer


def test_pre_rope_keys_are_coded_independently_of_position_and_post_rope_ones_are_not(kvquant3, held_out, smollm2):
    post = get_scheme("kvquant-3:pre_rope=0", smollm2)
    k, v, p = held_out[5][0]
    moved = move(k, p, p + 100, rope_frequencies(smollm2.model, 5))
    same = {}
    for name, scheme in (("pre", kvquant3), ("post", post)):
        view = scheme.for_layer(5)
        here, there = view.encode(k, v, p, 0)[0], view.encode(moved, v, p + 100, 0)[0]
        same[name] = (here.codes == there.codes).float().mean().item()
    assert same["pre"] > 0.97 and same["post"] < 0.8
    pre_keys, post_keys = roundtrip(kvquant3, 5, 0, k, v, p)[2], roundtrip(post, 5, 0, k, v, p)[2]
    assert (pre_keys - post_keys).abs().max() > 1e-2


def test_bits_beat_kivi_at_the_same_width_on_keys(kvquant3, held_out, smollm2):
    """Held-out key reconstruction: 3-bit KVQuant (non-uniform, outliers aside) against 3-bit KIVI without its
    full-precision window, over every layer and head."""
    kivi = get_scheme("kivi-3:residual=0")
    err_kvq = err_kivi = 0.0
    for layer, heads in enumerate(held_out):
        for h, (k, v, p) in enumerate(heads):
            err_kvq += (roundtrip(kvquant3, layer, h, k, v, p)[2] - k).pow(2).sum().item()
            err_kivi += (kivi.decode(*kivi.encode(k, v, p, h), p, h)[0] - k).pow(2).sum().item()
    assert err_kvq < err_kivi


def test_bytes_held_are_codes_ranges_outliers_and_exact_rows(kvquant3, smollm2):
    ids = calibration_ids(smollm2.tokenizer, 12, 100)[11]
    cache = KVCache(smollm2.model.config, quant=kvquant3)
    with torch.no_grad():
        feed(smollm2, cache, ids)
    expected = 0
    for layer in cache.layers:
        for ek, ev in zip(layer.rows.qk, layer.rows.qv):
            assert ek.rows == ev.rows == 100  # every row encoded on arrival (no full-precision window)
            expected += 2 * 100 * 64 * 3 // 8  # 3-bit codes, keys and values
            expected += 2 * 2 * 100  # float16 range start and span per value row
            expected += (ek.out_vals.numel() + ev.out_vals.numel()) * (4 + 1 + 2)  # row, channel, float16 value
            expected += ek.exact_rows.numel() * 2 * (4 + 64 * 4)  # the sink's key and value, exact, with their index
    assert cache.kv_bytes() == expected


def test_kvquant_answers_and_refuses_what_it_cannot_hold(kvquant3, smollm2):
    context = "The Eiffel Tower is in Paris. It was designed by the company of the engineer Gustave Eiffel. " * 6
    a = answer(smollm2, context, "Who designed the Eiffel Tower?", "snapkv", 0.5, quant="kvquant-3", max_new_tokens=8)
    full = answer(smollm2, context, "Who designed the Eiffel Tower?", "snapkv", 0.5, max_new_tokens=8)
    assert a.tokens and a.kv_bytes < 0.3 * full.kv_bytes
    with pytest.raises(KVMemError, match="unknown quantization scheme 'kvquant-5'"):
        get_scheme("kvquant-5")
    with pytest.raises(KVMemError, match="kvquant takes"):
        get_scheme("kvquant-3:outliers=0.7")
    with pytest.raises(KVMemError, match="fitted per model"):
        KVCache(smollm2.model.config, quant=get_scheme("kvquant-3"))


def test_adaquant_gives_keys_the_bits_and_the_reverse_shows_the_asymmetry(held_out):
    k4v2, k2v4 = get_scheme("adaquant-k4v2"), get_scheme("adaquant-k2v4")
    assert k4v2.bits == k2v4.bits == 3 and k4v2.spec == "adaquant-k4v2"
    k, v, p = held_out[10][2]
    keys_a, values_a = k4v2.decode(*k4v2.encode(k, v, p, 2), p, 2)
    keys_b, values_b = k2v4.decode(*k2v4.encode(k, v, p, 2), p, 2)
    assert (keys_a - k).pow(2).mean() < 0.3 * (keys_b - k).pow(2).mean()
    assert (values_b - v).pow(2).mean() < 0.3 * (values_a - v).pow(2).mean()
    enc_a, enc_b = k4v2.encode(k, v, p, 2), k2v4.encode(k, v, p, 2)
    assert enc_a[0].bits == 4 and enc_a[1].bits == 2 and enc_b[0].bits == 2 and enc_b[1].bits == 4
    assert sum(t.numel() for e in enc_a for t in e.tensors()) == sum(t.numel() for e in enc_b for t in e.tensors())
    with pytest.raises(KVMemError, match="adaquant takes"):
        AdaQuant(5, 2)


def test_encoded_rows_round_trip_through_export(kvquant3, smollm2):
    """Sparse outliers and exact sinks leave and come back as held (the chunk store keeps these bytes)."""
    ids = calibration_ids(smollm2.tokenizer, 12, 40)[11]
    source = KVCache(smollm2.model.config, quant=kvquant3)
    with torch.no_grad():
        feed(smollm2, source, ids)
    target = KVCache(smollm2.model.config, quant=kvquant3)
    for a, b in zip(source.layers, target.layers):
        b.import_rows(a.export_rows())
        for (ka, va, pa), (kb, vb, pb) in zip(a.rows.heads(), b.rows.heads()):
            assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pa, pb)
    assert target.kv_bytes() == source.kv_bytes()

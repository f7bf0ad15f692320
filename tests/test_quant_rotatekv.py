"""RotateKV (`rotatekv-2`): the Hadamard transform, the fitted channel order, pre-RoPE rotation, exact sinks,
bytes held, generation and the calibration artefact (real SmolLM2 keys)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.calibration import calibration_ids
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer
from kvmem.quant import get_scheme
from kvmem.quant.pack import dequantize, quantize
from kvmem.quant.rotatekv import fwht, hadamard
from kvmem.rope import move, rope_frequencies


@pytest.fixture(scope="module")
def rotatekv(smollm2, tmp_path_factory):
    """rotatekv-2 fitted for SmolLM2 once, into a fresh artefact folder (later get_scheme calls reuse it in memory)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMEM_CACHE_DIR", str(tmp_path_factory.mktemp("kvmem-rotatekv")))
        return get_scheme("rotatekv-2", smollm2)


@pytest.fixture(scope="module")
def held_out(smollm2):
    """Per layer and KV head, the full-precision (keys, values, positions) of 256 tokens after the calibration
    stretch (the fit reads tokens 0-1023 of the shipped text; these are 1024-1279)."""
    ids = calibration_ids(smollm2.tokenizer, 5, 256)[4]
    cache = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, cache, ids)
    return [layer.rows.heads() for layer in cache.layers]


def reconstruction_mse(view_of, held_out) -> float:
    """Mean squared key error of encode -> decode with `view_of(layer)` over every layer and head."""
    total, count = 0.0, 0
    for i, heads in enumerate(held_out):
        view = view_of(i)
        for h, (k, v, p) in enumerate(heads):
            keys, _ = view.decode(*view.encode(k, v, p, h), p, h)
            total += (keys - k).pow(2).sum().item()
            count += k.numel()
    return total / count


@pytest.mark.parametrize("d", [1, 2, 16, 64])
def test_fwht_is_the_orthonormal_sylvester_hadamard(d):
    h = hadamard(d)
    torch.testing.assert_close(h @ h.T, torch.eye(d))
    if d > 1:  # Sylvester's construction, explicitly
        torch.testing.assert_close(h, torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), hadamard(d // 2)) / 2 ** 0.5)
    torch.testing.assert_close(fwht(torch.eye(d)), h)
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(fwht(x), x @ h)
    torch.testing.assert_close(fwht(fwht(x)), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1))


def test_fwht_and_the_scheme_refuse_sizes_they_cannot_rotate(tiny_llama):
    with pytest.raises(KVMemError, match="power-of-two"):
        fwht(torch.zeros(2, 48))
    with pytest.raises(KVMemError, match="head_dim 48 is not a power of two"):
        get_scheme("rotatekv-2").check(48)
    with pytest.raises(KVMemError, match="multiple of the group 32"):
        get_scheme("rotatekv-2").check(16)
    get_scheme("rotatekv-2:group=8").check(16)
    with pytest.raises(KVMemError, match="clip"):
        get_scheme("rotatekv-2:clip=1.5")
    with pytest.raises(KVMemError, match="fitted per model"):  # a calibrated scheme needs its model
        KVCache(tiny_llama.config, quant=get_scheme("rotatekv-2:group=8"))


@pytest.mark.parametrize("spec", ["rotatekv-2", "rotatekv-4", "rotatekv-3:group=16",
                                  "rotatekv-2:clip=0.9:pre_rope=false:residual=64", "rotatekv-2:sinks=false"])
def test_spec_round_trips(spec):
    scheme = get_scheme(spec)
    assert scheme.spec == spec and get_scheme(scheme.spec).spec == spec
    assert not scheme.ready and scheme.calibrated


def test_prepared_scheme_is_bound_per_layer_with_its_own_order(rotatekv, smollm2):
    assert rotatekv.ready and rotatekv.bits == 2 and rotatekv.group == 32 and rotatekv.residual == 0
    assert rotatekv.clip == 0.8  # the reference's 2-bit clipping
    views = [rotatekv.for_layer(i) for i in range(smollm2.model.config.num_hidden_layers)]
    for view in views:  # a permutation of the channels per KV head
        assert view.order.shape == (3, 64)
        assert torch.equal(view.order.sort(-1).values, torch.arange(64).expand(3, 64))
    assert not torch.equal(views[3].order, views[20].order)
    assert not torch.equal(views[3].order[0], torch.arange(64))
    with pytest.raises(KVMemError, match="view of one layer"):
        rotatekv.encode(torch.zeros(32, 64), torch.zeros(32, 64), torch.arange(32), 0)


def test_rotation_and_order_beat_plain_per_token_2_bit(rotatekv, held_out, smollm2):
    """The point of the method: on held-out SmolLM2 keys, rotated, reordered 2-bit codes reconstruct keys far
    better than the same per-token groups without rotation; the fitted order accounts for part of it."""
    def plain(clip):
        def quant(x):
            g = x.reshape(x.shape[0], -1, 32)
            lo, hi = g.amin(-1, keepdim=True) * clip, g.amax(-1, keepdim=True) * clip
            return dequantize(quantize(torch.minimum(torch.maximum(g, lo), hi).reshape(x.shape), 2, 32, dim=1))
        ks = [(quant(k) - k).pow(2).sum().item() for heads in held_out for k, _, _ in heads]
        return sum(ks) / sum(k.numel() for heads in held_out for k, _, _ in heads)

    no_sinks = get_scheme("rotatekv-2:sinks=false", smollm2)
    rotated = reconstruction_mse(no_sinks.for_layer, held_out)

    def identity_order(i):
        view = no_sinks.for_layer(i)
        view.order = view.inverse = torch.arange(64).expand(3, 64)
        return view

    unordered = reconstruction_mse(identity_order, held_out)
    assert rotated < 0.5 * plain(1.0) and rotated < 0.5 * plain(0.8)
    assert rotated < 0.8 * unordered < 0.8 * plain(0.8)


def test_pre_rope_codes_do_not_depend_on_position_and_post_rope_ones_do(rotatekv, held_out, smollm2):
    """Keys are quantized before RoPE: the same key moved 100 positions on gets the same codes (up to float
    rounding at code boundaries); quantized after RoPE (the neighbour), its codes change, and so does the error."""
    post = get_scheme("rotatekv-2:pre_rope=false", smollm2)
    inv_freq = rope_frequencies(smollm2.model, 5)
    k, v, p = held_out[5][0]
    moved = move(k, p, p + 100, inv_freq)
    same = {}
    for name, scheme in (("pre", rotatekv), ("post", post)):
        view = scheme.for_layer(5)
        here, there = view.encode(k, v, p, 0)[0], view.encode(moved, v, p + 100, 0)[0]
        codes = lambda e: torch.stack([(e.codes.packed >> s) & 3 for s in (0, 2, 4, 6)])  # noqa: E731
        same[name] = (codes(here) == codes(there)).float().mean().item()
    assert same["pre"] > 0.99 and same["post"] < 0.9
    pre_view, post_view = rotatekv.for_layer(5), post.for_layer(5)
    pre_keys = pre_view.decode(*pre_view.encode(k, v, p, 0), p, 0)[0]
    post_keys = post_view.decode(*post_view.encode(k, v, p, 0), p, 0)[0]
    assert (pre_keys - post_keys).abs().max() > 1e-2
    assert reconstruction_mse(rotatekv.for_layer, held_out) < reconstruction_mse(post.for_layer, held_out)


def test_sinks_are_held_exactly(rotatekv, held_out, smollm2):
    view = rotatekv.for_layer(5)
    k, v, p = (t.clone() for t in held_out[5][1])
    v[70] *= 1e-3  # a value as near zero as a massive-activation token's
    ek, ev = view.encode(k, v, p, 1)
    sinks = ek.index.long()
    assert {0, 70} <= set(sinks.tolist()) and len(sinks) < 0.1 * len(p)  # the first token, the near-zero value
    assert torch.equal(ev.index, ek.index)
    keys, values = view.decode(ek, ev, p, 1)
    assert torch.equal(keys[sinks], k[sinks]) and torch.equal(values[sinks], v[sinks])
    others = torch.ones(len(p), dtype=torch.bool)
    others[sinks] = False
    assert (keys[others] != k[others]).any(dim=-1).all()  # the rest is quantized
    # without sink awareness, the same rows are quantized too
    plain = get_scheme("rotatekv-2:sinks=false", smollm2).for_layer(5)
    assert not torch.equal(plain.decode(*plain.encode(k, v, p, 1), p, 1)[1][0], v[0])
    # sinks follow their rows when blocks join and when leading blocks are dropped (a sliding window)
    joined = ek.cat(ek)
    assert joined.index.tolist() == ek.index.tolist() + (ek.index + len(p)).tolist()
    dropped = joined.drop(64)
    assert dropped.index.tolist() == [i - 64 for i in joined.index.tolist() if i >= 64] and dropped.rows == 2 * len(p) - 64
    assert torch.equal(dropped.exact, joined.exact[joined.index >= 64])


def test_bytes_held_are_below_kivi_4_and_count_the_sinks(rotatekv, smollm2):
    ids = calibration_ids(smollm2.tokenizer, 5, 200)[4]

    def cache_for(spec):
        cache = KVCache(smollm2.model.config, quant=get_scheme(spec, smollm2))
        with torch.no_grad():
            feed(smollm2, cache, ids)
        return cache

    cache, no_sinks, kivi4 = cache_for("rotatekv-2"), cache_for("rotatekv-2:sinks=false"), cache_for("kivi-4")
    d, encoded, residual = 64, 192, 8  # 200 rows: 6 blocks of 32 encoded, 8 in full precision (float32)
    per_head = 2 * encoded * d * 2 // 8 + 2 * 2 * 2 * encoded * d // 32 + 2 * residual * d * 4  # codes, scale+zero, rest
    sinks = [layer.rows.qk[h].index.numel() for layer in cache.layers for h in range(3)]
    assert min(sinks) >= 1  # the first token, at least
    assert no_sinks.kv_bytes() == len(sinks) * per_head
    assert cache.kv_bytes() == len(sinks) * per_head + sum(sinks) * 2 * (d * 4 + 4)  # exact rows and their index
    assert cache.kv_bytes() < kivi4.kv_bytes() / 2


def test_quantized_answer_runs(rotatekv, smollm2):
    context = ("The Eiffel Tower is in Paris. It was completed in 1889 and designed by the company of the engineer "
               "Gustave Eiffel. It is 330 metres tall. ") * 5
    full = answer(smollm2, context, "Who designed the Eiffel Tower?", "snapkv", 0.5, max_new_tokens=8)
    quantized = answer(smollm2, context, "Who designed the Eiffel Tower?", "snapkv", 0.5, quant="rotatekv-2",
                       max_new_tokens=8)
    assert quantized.tokens and quantized.kv_bytes_full < 0.5 * full.kv_bytes_full
    assert quantized.kv_bytes < 0.5 * full.kv_bytes


def test_artefact_is_refitted_when_the_fingerprint_differs(smollm2, tmp_path, monkeypatch):
    from kvmem import calibration
    from kvmem.quant import rotatekv as module

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    fits = []

    def fake_fit(lm, sequences, length, top):
        fits.append(lm.fingerprint)
        out = {}
        for i in range(lm.model.config.num_hidden_layers):
            out[f"layer.{i}.order"] = torch.arange(63, -1, -1).float().expand(3, 64)
            out[f"layer.{i}.order_post"] = torch.arange(64).float().expand(3, 64)
            out[f"layer.{i}.sink"] = torch.full((3,), float(len(fits)))
        return out

    monkeypatch.setattr(module, "fit_rotatekv", fake_fit)
    scheme = get_scheme("rotatekv-2", smollm2)
    assert fits == [smollm2.fingerprint] and calibration.artefact_path("rotatekv-order", smollm2.name, dict(sequences=2, length=512, top=20)).exists()
    assert scheme.for_layer(0).order[0].tolist() == list(range(63, -1, -1))  # what was fitted is what is used
    calibration._LOADED.clear()
    assert get_scheme("rotatekv-2", smollm2).for_layer(4).threshold.tolist() == [1.0] * 3  # read from disk
    assert len(fits) == 1
    calibration._LOADED.clear()
    other = dataclasses.replace(smollm2, fingerprint="other-weights")
    assert get_scheme("rotatekv-2", other).for_layer(4).threshold.tolist() == [2.0] * 3
    assert fits == [smollm2.fingerprint, "other-weights"]

"""Coupled Quantization (`cq-2`, `cq-1`): batched weighted k-means, learned codebooks over coupled channels
on real SmolLM2 keys and values, pre-RoPE coupling, bytes held, generation (SmolLM2, Gemma-3's sliding layers)
and the calibration artefact.

The codebooks here are fitted on a small calibration stretch (`FIT`, tokens 0-511 of the shipped text; the
fits of one model share its calibration pass) to keep the file quick; the reconstruction tests read tokens
1024-1279, which no fit saw."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.calibration import calibration_ids
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import answer
from kvmem.quant import get_scheme
from kvmem.quant.cq import CoupledQuantization, fit_codebooks, kmeans, nearest
from kvmem.quant.pack import dequantize, quantize
from kvmem.rope import move, rope_frequencies

FIT = "sequences=1:length=512:samples=512:iters=6"  # a quick fit (the defaults take a minute or two per model)


class Fits:
    """The module's fits: into one fresh artefact folder (later get_scheme calls reuse them in memory), each
    model's calibration activations computed once and shared by its fits."""

    def __init__(self, folder):
        from kvmem.quant import calibrate

        self.folder, self.real, self.memo = folder, calibrate.calibration_kv, {}

    def shared(self, lm, *args, **kwargs):
        key = (lm.fingerprint, args, tuple(sorted(kwargs.items())))
        if key not in self.memo:
            self.memo[key] = self.real(lm, *args, **kwargs)
        return self.memo[key]

    def run(self, fit):
        from kvmem.quant import calibrate

        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVMEM_CACHE_DIR", str(self.folder))
            mp.setattr(calibrate, "calibration_kv", self.shared)
            return fit()

    def prepare(self, spec, lm):
        return self.run(lambda: get_scheme(spec, lm))


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = Fits(tmp_path_factory.mktemp("kvmem-cq"))
    yield out
    out.memo.clear()


@pytest.fixture(scope="module")
def cq2(smollm2, fits):
    return fits.prepare(f"cq-2:{FIT}", smollm2)


@pytest.fixture(scope="module")
def cq1(smollm2, fits):
    return fits.prepare(f"cq-1:{FIT}", smollm2)


@pytest.fixture(scope="module")
def held_out(smollm2):
    """Per layer and KV head, the full-precision (keys, values, positions) of tokens 1024-1279 of the shipped
    text (the fits read tokens 0-511)."""
    ids = calibration_ids(smollm2.tokenizer, 5, 256)[4]
    cache = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, cache, ids)
    return [layer.rows.heads() for layer in cache.layers]


def reconstruction_mse(scheme, held_out) -> tuple[float, float]:
    """Mean squared key and value errors of encode -> decode over every layer and head."""
    err_k = err_v = count = 0.0
    for i, heads in enumerate(held_out):
        view = scheme.for_layer(i)
        for h, (k, v, p) in enumerate(heads):
            keys, values = view.decode(*view.encode(k, v, p, h), p, h)
            err_k += (keys - k).pow(2).sum().item()
            err_v += (values - v).pow(2).sum().item()
            count += k.numel()
    return err_k / count, err_v / count


# -- k-means ----------------------------------------------------------------------------------------------
def test_nearest_is_the_brute_force_argmin_in_slices():
    g = torch.Generator().manual_seed(0)
    x, c = torch.randn(5, 300, 4, generator=g), torch.randn(5, 16, 4, generator=g)
    brute = torch.cdist(x, c).argmin(-1)
    assert torch.equal(nearest(x, c), brute)
    assert torch.equal(nearest(x, c, chunk=1000), brute)  # one group at a time


@pytest.mark.parametrize("seed", range(4))
def test_kmeans_recovers_well_separated_clusters(seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[10.0, 10.0], [-10.0, 10.0], [10.0, -10.0], [-10.0, -10.0], [0.0, 0.0]])
    # two groups at once, the second with its clusters moved
    x = torch.stack([(centers[:, None] + 0.1 * torch.randn(5, 60, 2, generator=g)).reshape(-1, 2),
                     (centers[:, None] * 2 + 3 + 0.1 * torch.randn(5, 60, 2, generator=g)).reshape(-1, 2)])
    x = x[:, torch.randperm(300, generator=g)]
    found = kmeans(x, 5, seed=seed)
    for group, want in ((0, centers), (1, centers * 2 + 3)):
        match = torch.cdist(want, found[group])  # each true center has exactly one centroid within 0.1
        assert (match.min(-1).values < 0.1).all() and torch.equal(match.argmin(-1).sort().values, torch.arange(5))


def test_weights_pull_a_centroid():
    x = torch.tensor([[[0.0, 0.0], [1.0, 2.0]]])
    torch.testing.assert_close(kmeans(x, 1), torch.tensor([[[0.5, 1.0]]]))
    torch.testing.assert_close(kmeans(x, 1, torch.tensor([[3.0, 1.0]])), torch.tensor([[[0.25, 0.5]]]))
    # Fisher weights are tiny (squared gradients): only their ratios count; all-zero weights are ignored
    torch.testing.assert_close(kmeans(x, 1, torch.tensor([[3e-12, 1e-12]])), torch.tensor([[[0.25, 0.5]]]))
    torch.testing.assert_close(kmeans(x, 1, torch.zeros(1, 2)), torch.tensor([[[0.5, 1.0]]]))
    # with two clusters, a heavy point drags its cluster's centroid towards itself
    pts = torch.tensor([[[0.0], [1.0], [10.0], [11.0]]])
    assert sorted(kmeans(pts, 2, torch.tensor([[1.0, 1.0, 1.0, 9.0]]))[0, :, 0].tolist()) == pytest.approx([0.5, 10.9])


# -- the fitted scheme --------------------------------------------------------------------------------------
def test_prepared_scheme_holds_a_codebook_per_layer_head_and_channel_group(cq2, cq1, smollm2):
    assert cq2.ready and cq2.bits == 2 and cq2.channels == 4 and cq2.group == 1 and cq2.residual == 32
    assert cq1.bits == 1 and cq1.channels == 8
    layers = smollm2.model.config.num_hidden_layers
    assert len(cq2.books) == 2 * layers
    for scheme, groups, c in ((cq2, 16, 4), (cq1, 8, 8)):
        view = scheme.for_layer(7)
        assert view.key_book.shape == view.value_book.shape == (3, groups, 256, c)
        assert torch.isfinite(view.key_book).all()
        # 256 distinct centroids (k-means++ seeding picks distinct points)
        assert len(torch.unique(view.key_book[1, 3], dim=0)) == 256
    assert not torch.equal(cq2.for_layer(3).key_book, cq2.for_layer(20).key_book)
    assert not torch.equal(cq2.for_layer(3).key_book[0], cq2.for_layer(3).key_book[1])  # per KV head
    with pytest.raises(KVMemError, match="view of one layer"):
        cq2.encode(torch.zeros(4, 64), torch.zeros(4, 64), torch.arange(4), 0)
    with pytest.raises(KVMemError, match="no codebook for layer 30"):
        cq2.for_layer(layers)


def test_coupled_codes_beat_plain_2_bit_and_channel_independent_codebooks(cq2, cq1, held_out, smollm2, fits):
    """The point of the method: on held-out SmolLM2 KV, 4 coupled channels per 8-bit code (2 bits per channel,
    nothing else stored) reconstruct keys and values far better than per-token 2-bit min-max groups of 32
    (which also store a float16 scale and zero-point per group), and better than 2-bit codebooks learned for
    each channel alone (c = 1, the same k-means on the same rows); 1 bit per channel costs accuracy."""
    coupled_k, coupled_v = reconstruction_mse(cq2, held_out)
    one_bit_k, one_bit_v = reconstruction_mse(cq1, held_out)

    def plain(x):
        return (dequantize(quantize(x, 2, 32, dim=1)) - x).pow(2).sum().item()

    n = sum(k.numel() for heads in held_out for k, _, _ in heads)
    plain_k = sum(plain(k) for heads in held_out for k, _, _ in heads) / n
    plain_v = sum(plain(v) for heads in held_out for _, v, _ in heads) / n
    params = dict(cq2.fit_params, channels=1, code_bits=2)
    independent = copy.copy(cq2)
    independent.books = fits.run(lambda: fit_codebooks(smollm2, **params))
    assert independent.books["layer.0.keys"].shape == (3, 64, 4, 1)
    single_k, single_v = reconstruction_mse(independent, held_out)
    assert coupled_k + coupled_v < 0.5 * (plain_k + plain_v)
    assert coupled_k < 0.2 * plain_k and coupled_v < 0.8 * plain_v
    assert coupled_k + coupled_v < 0.9 * (single_k + single_v)
    assert one_bit_k + one_bit_v > 1.5 * (coupled_k + coupled_v)


def test_keys_are_coupled_before_rope(cq2, held_out, smollm2, fits):
    """Pre-RoPE codes do not depend on the position: the same key moved 100 positions on gets the same codes
    (up to float rounding at cell boundaries), while coupled after RoPE (`pre_rope=false`, its own fit), the
    codes change; and the two give different reconstructions."""
    post = fits.prepare(f"cq-2:{FIT}:pre_rope=false", smollm2)
    assert post.inv_freq is None and "pre_rope=false" in post.spec and cq2.inv_freq is not None
    k, v, p = held_out[5][0]
    moved = move(k, p, p + 100, rope_frequencies(smollm2.model, 5))
    same = {}
    for name, scheme in (("pre", cq2), ("post", post)):
        view = scheme.for_layer(5)
        here, there = view.encode(k, v, p, 0)[0], view.encode(moved, v, p + 100, 0)[0]
        same[name] = (here.codes() == there.codes()).float().mean().item()
    assert same["pre"] > 0.99 and same["post"] < 0.9
    pre_view, post_view = cq2.for_layer(5), post.for_layer(5)
    pre_keys = pre_view.decode(*pre_view.encode(k, v, p, 0), p, 0)[0]
    post_keys = post_view.decode(*post_view.encode(k, v, p, 0), p, 0)[0]
    assert (pre_keys - post_keys).abs().max() > 1e-2
    # only the keys are fitted differently: values never see RoPE
    assert not torch.equal(cq2.for_layer(5).key_book, post.for_layer(5).key_book)
    assert torch.equal(cq2.for_layer(5).value_book, post.for_layer(5).value_book)


def test_codes_are_one_byte_per_group_and_survive_joins_and_drops(cq2, held_out):
    view = cq2.for_layer(2)
    k, v, p = held_out[2][1]
    ek, ev = view.encode(k, v, p, 1)
    assert ek.packed.dtype == torch.uint8 and ek.packed.shape == (len(p), 16) and ek.rows == len(p)
    keys, values = view.decode(ek, ev, p, 1)
    assert keys.dtype == k.dtype and keys.shape == k.shape and values.shape == v.shape
    joined = ek.cat(ek)
    assert joined.rows == 2 * len(p) and torch.equal(joined.drop(len(p)).packed, ek.packed)
    # the decoded values are the codebook's centroids, group by group
    codes = ev.codes()
    torch.testing.assert_close(values[:, 4:8], view.value_book[1, 1][codes[:, 1]])


def test_bytes_held_are_the_codes_and_the_full_precision_residual(cq2, cq1, smollm2):
    ids = calibration_ids(smollm2.tokenizer, 5, 200)[4]

    def held(scheme):
        cache = KVCache(smollm2.model.config, quant=scheme)
        with torch.no_grad():
            feed(smollm2, cache, ids)
        return cache

    d, encoded, residual, heads = 64, 168, 32, 30 * 3  # 200 rows: the newest 32 stay float32, 168 are codes
    for scheme, bits in ((cq2, 2), (cq1, 1)):
        cache = held(scheme)
        assert cache.kv_bytes() == heads * (2 * encoded * d * bits // 8 + 2 * residual * d * 4)
        assert all(layer.rows.qk[h].rows == encoded for layer in cache.layers for h in range(3))
    full = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, full, ids)
    assert full.kv_bytes() == heads * 2 * 200 * d * 4


def test_quantized_answer_runs(cq2, smollm2):
    context = ("The Eiffel Tower is in Paris. It was completed in 1889 and designed by the company of the engineer "
               "Gustave Eiffel. It is 330 metres tall. ") * 5
    question = "Who designed the Eiffel Tower?"
    full = answer(smollm2, context, question, "snapkv", 0.5, max_new_tokens=8)
    quantized = answer(smollm2, context, question, "snapkv", 0.5, quant=cq2.spec, max_new_tokens=8)
    assert quantized.tokens and quantized.kv_bytes_full < 0.5 * full.kv_bytes_full
    assert quantized.kv_bytes < full.kv_bytes


def test_gemma_sliding_layers_run_quantized(gemma3, fits):
    """Gemma-3 (head_dim 256, 1 KV head, sliding layers of 512 with their own RoPE base): a context longer than
    the window, quantized with codebooks fitted for it."""
    scheme = fits.prepare("cq-2:sequences=1:length=256:samples=256:iters=4", gemma3)
    view = scheme.for_layer(0)
    assert view.key_book.shape == (1, 64, 256, 4)
    context = " ".join(f"Item {i} is stored in box {i * 7 % 31}." for i in range(60))  # 690 tokens
    out = answer(gemma3, context, "Which box holds item 12?", "snapkv", 0.5, quant=scheme.spec, max_new_tokens=6)
    full = answer(gemma3, context, "Which box holds item 12?", "snapkv", 0.5, max_new_tokens=6)
    assert out.tokens and out.kv_bytes < 0.5 * full.kv_bytes


# -- specs, errors and the artefact ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["cq-2", "cq-1", "cq-2:pre_rope=false:residual=0", "cq-1:fisher=false:samples=1024",
                                  "cq-2:iters=5:length=256:seed=3:sequences=3"])
def test_spec_round_trips(spec):
    scheme = get_scheme(spec)
    assert scheme.spec == spec and get_scheme(scheme.spec).spec == spec
    assert not scheme.ready and scheme.calibrated and isinstance(scheme, CoupledQuantization)


def test_named_errors(tiny_llama):
    with pytest.raises(KVMemError, match="1 or 2 bits"):
        CoupledQuantization(3)
    with pytest.raises(KVMemError, match="unknown quantization scheme 'cq-4'"):
        get_scheme("cq-4")
    with pytest.raises(KVMemError, match="residual >= 0"):
        get_scheme("cq-2:residual=-1")
    with pytest.raises(KVMemError, match="samples"):
        get_scheme("cq-2:samples=0")
    with pytest.raises(KVMemError, match="head_dim 12 is not a multiple of the 8 coupled channels"):
        get_scheme("cq-1").check(12)
    with pytest.raises(KVMemError, match="head_dim 6 is not a multiple of the 4 coupled channels"):
        get_scheme("cq-2").check(6)
    get_scheme("cq-1").check(16)
    with pytest.raises(KVMemError, match="fitted per model"):  # a calibrated scheme needs its model
        KVCache(tiny_llama.config, quant=get_scheme("cq-2"))
    with pytest.raises(KVMemError, match="fitted per model"):
        get_scheme("cq-2").for_layer(0)


def test_artefact_is_refitted_when_the_fingerprint_differs(smollm2, tmp_path, monkeypatch):
    from kvmem import calibration
    from kvmem.quant import cq as module

    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_LOADED", {})
    fits = []

    def fake_fit(lm, sequences, length, samples, iters, fisher, pre_rope, seed, channels, code_bits):
        fits.append((lm.fingerprint, channels, code_bits, pre_rope))
        books = torch.full((3, 64 // channels, 1 << code_bits, channels), float(len(fits)))
        return {f"layer.{i}.{kind}": books.clone() for i in range(lm.model.config.num_hidden_layers)
                for kind in ("keys", "values")}

    monkeypatch.setattr(module, "fit_codebooks", fake_fit)
    unprepared = get_scheme("cq-2")
    scheme = unprepared.prepare(smollm2)
    assert not unprepared.ready and unprepared.books is None and scheme.ready  # a prepared copy
    assert fits == [(smollm2.fingerprint, 4, 8, True)] and calibration.artefact_path("cq-2", smollm2.name, unprepared.fit_params).exists()
    assert scheme.for_layer(0).key_book.unique().tolist() == [1.0]  # what was fitted is what is used
    calibration._LOADED.clear()
    assert get_scheme("cq-2", smollm2).for_layer(4).value_book.unique().tolist() == [1.0]  # read from disk
    assert len(fits) == 1
    calibration._LOADED.clear()
    other = dataclasses.replace(smollm2, fingerprint="other-weights")
    assert get_scheme("cq-2", other).for_layer(4).value_book.unique().tolist() == [2.0]
    assert fits[-1] == ("other-weights", 4, 8, True)
    get_scheme("cq-2:pre_rope=false", smollm2)  # other parameters: refitted too
    assert fits[-1] == (smollm2.fingerprint, 4, 8, False) and len(fits) == 3
    # an artefact of the wrong shape (another model's head_dim) is refused, not silently used
    monkeypatch.setattr(module, "fit_codebooks", lambda lm, **kw: {f"layer.{i}.{kind}": torch.zeros(3, 8, 256, 8)
                                                                  for i in range(30) for kind in ("keys", "values")})
    with pytest.raises(KVMemError, match="does not match"):
        get_scheme("cq-2:seed=1", smollm2)

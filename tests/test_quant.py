"""Bit-packing and group quantization: exact round trips, bytes held, error bounds per bit width."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.errors import KVMemError
from kvmem.quant.pack import BITS, concat, dequantize, pack, quantize, stack, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BITS), n=st.integers(1, 70), rows=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip_and_bytes(bits, n, rows, seed):
    codes = torch.randint(0, 1 << bits, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == (n if bits == 8 else -(-n // 8) * bits)  # bits/8 bytes per code, not one byte
    assert torch.equal(unpack(packed, bits, n), codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [0, 1])
def test_quantization_error_is_at_most_half_a_step(bits, dim):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(bits)) * 3
    q = quantize(x, bits, 32, dim=dim)
    err = (dequantize(q) - x).abs()
    step = q.scale.float().repeat_interleave(32, dim=-1)  # per element, in the moved layout
    step = step.movedim(-1, dim) if dim == 0 else step
    assert (err <= step / 2 + 2e-3 * x.abs().max()).all()  # + float16 rounding of scale and zero-point
    assert q.nbytes == x.numel() * bits // 8 + 2 * 2 * (x.numel() // 32)


def test_group_axis_matters():
    """Per-channel groups (along tokens) and per-token groups (along channels) are different quantizers."""
    x = torch.randn(32, 32) + torch.linspace(-20, 20, 32)  # channels with their own offsets, as keys have
    per_channel, per_token = dequantize(quantize(x, 2, 32, dim=0)), dequantize(quantize(x, 2, 32, dim=1))
    assert (per_channel - x).pow(2).mean() < 0.1 * (per_token - x).pow(2).mean()


def test_bad_quantization_requests_are_named_errors():
    with pytest.raises(KVMemError, match="5-bit"):
        pack(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(KVMemError, match="groups of 32"):
        quantize(torch.zeros(4, 33), 2, 32, dim=1)


@pytest.mark.parametrize("dim", [0, 1])
def test_quantized_parts_join_like_their_tensors(dim):
    """Keys grow by blocks of tokens (grouped along tokens), values token by token (grouped along channels)."""
    a, b = torch.randn(32, 64), torch.randn(64, 64)
    joined = concat([quantize(a, 3, 32, dim=dim), quantize(b, 3, 32, dim=dim)], dim=0)
    torch.testing.assert_close(dequantize(joined), torch.cat([dequantize(quantize(a, 3, 32, dim=dim)),
                                                              dequantize(quantize(b, 3, 32, dim=dim))]))
    assert joined.shape == (96, 64)


@pytest.mark.parametrize("dim", [0, 1])
def test_heads_decode_together_into_a_slice_of_the_layer_buffer(dim):
    """A decode step decodes all heads in one pass into the first rows of an (H, T, D) buffer."""
    parts = [quantize(torch.randn(64, 64), 2, 32, dim=dim) for _ in range(3)]
    out = torch.zeros(3, 70, 64)
    dequantize(stack(parts), out[:, :64])
    assert torch.equal(out[:, :64], torch.stack([dequantize(p) for p in parts]))
    assert not out[:, 64:].any()
    with pytest.raises(KVMemError, match="share"):
        stack([parts[0], quantize(torch.randn(32, 64), 2, 32, dim=dim)])


# -- quantized caches ----------------------------------------------------------------------------------
from kvmem.cache import KVCache  # noqa: E402
from kvmem.compress import Compressor, compress, get_method  # noqa: E402
from kvmem.quant import get_scheme  # noqa: E402


def random_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, ids: torch.Tensor, chunks: int = 1, **cache_kwargs) -> tuple[torch.Tensor, KVCache]:
    """Feed ids in `chunks` forwards (later chunks read what earlier ones left, quantized); all logits."""
    if isinstance(cache_kwargs.get("quant"), str):
        cache_kwargs["quant"] = get_scheme(cache_kwargs["quant"])
    cache = KVCache(model.config, **cache_kwargs)
    with torch.no_grad():
        logits = [model(input_ids=part, cache=cache, use_cache=True).logits for part in ids.chunk(chunks, dim=1)]
    return torch.cat(logits, 1), cache


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_8_bit_cache_matches_full_precision_and_2_bit_does_not(kind, request):
    model = request.getfixturevalue(kind)
    ids = random_ids(96, 1)
    full, _ = run(model, ids, chunks=6)
    q8, _ = run(model, ids, chunks=6, quant="kivi-8:group=8:residual=8")
    q2, _ = run(model, ids, chunks=6, quant="kivi-2:group=8:residual=0")
    torch.testing.assert_close(q8, full, atol=2e-2, rtol=0)
    assert (q2 - full).abs().max() > 10 * (q8 - full).abs().max()  # the bits are really dropped


def test_decode_steps_from_quantized_rows_match_full_precision(tiny_llama, monkeypatch):
    """Without the decode kernel, decode steps read every head decoded into one buffer (all heads in one pass, or head
    by head for a scheme without a batched decode: the same rows) through kvmem's GQA attention (no repeat_kv): the
    same logits as the full-precision cache, up to the codes' error."""
    from kvmem.layer import KVLayer
    from kvmem.quant.base import Scheme
    from kvmem.quant.kivi import KIVI

    monkeypatch.setattr(KVLayer, "_decodes_in_place", lambda self, new_pos, batched=False: False)

    class HeadByHead(KIVI):  # a scheme that does not join its heads' codes
        join_heads = Scheme.join_heads

    ids = random_ids(60, 7)
    caches = [KVCache(tiny_llama.config), KVCache(tiny_llama.config, quant=KIVI(8, group=8, residual=8)),
              KVCache(tiny_llama.config, quant=HeadByHead(8, group=8, residual=8))]
    logits = []
    with torch.no_grad():
        for cache in caches:
            tiny_llama(input_ids=ids[:, :52], cache=cache, use_cache=True)
            logits.append(torch.cat([tiny_llama(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits
                                     for i in range(52, 60)], 1))
    together, one_by_one = (c.layers[0].rows.stacked() for c in caches[1:])
    assert caches[1].layers[0].rows.qk[0].rows == 48  # encoded rows are read, not only the residual
    for a, b in zip(together, one_by_one):
        assert torch.equal(a, b)
    torch.testing.assert_close(logits[1], logits[0], atol=2e-2, rtol=0)
    assert torch.equal(logits[1], logits[2])


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
def test_ragged_quantized_heads_decode_in_one_pass_as_head_by_head(kind, request, monkeypatch):
    """Heads of different lengths (adaptive budgets) held quantized, without the decode kernel (a scheme without one, a
    multi-token forward): a decode step decodes every head onto one row axis
    and runs one attention call (`flat_attention`), with each query head masked to its KV head's rows (and, on Gemma's
    sliding layers, to the window). The logits are those of attention head by head, up to float summation order,
    and the joined codes are held once (the heads' codes are views of them)."""
    import kvmem.attention as attention
    from kvmem.layer import KVLayer

    model = request.getfixturevalue(kind)
    ids = random_ids(90, 8)
    _, cache = run(model, ids[:, :80], quant="kivi-4:group=8:residual=8", observe_window=32)
    compress(cache, get_method("snapkv:budget=adaptive"), 0.5)
    assert any(len(set(layer.lengths())) > 1 for layer in cache.layers)  # ragged
    reference = cache.clone()
    calls, one_pass = [], attention.flat_attention
    monkeypatch.setattr(attention, "flat_attention", lambda *a: calls.append(1) or one_pass(*a))
    monkeypatch.setattr(KVLayer, "_decodes_in_place", lambda self, new_pos, batched=False: False)  # PyTorch's path, not the kernel
    with torch.no_grad():
        flat = torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(80, 90)], 1)
        monkeypatch.setattr(KVLayer, "_flat_rows", lambda self, new_pos: None)
        head_by_head = torch.cat([model(input_ids=ids[:, i:i + 1], cache=reference, use_cache=True).logits
                                  for i in range(80, 90)], 1)
    assert calls  # the one-pass path ran
    torch.testing.assert_close(flat, head_by_head, atol=1e-4, rtol=0)
    assert cache.kv_bytes() == reference.kv_bytes()
    for a, b in zip(cache.layers, reference.layers):  # the same rows (new ones up to the float differences above)
        for (ka, va, pa), (kb, vb, pb) in zip(a.rows.heads(), b.rows.heads()):
            assert torch.equal(pa, pb)
            torch.testing.assert_close((ka, va), (kb, vb), atol=1e-3, rtol=0)


def test_the_decode_kernel_builds_and_reads_codes_as_they_decode():
    """The kernel (`kvmem.kernel`, built on first use) against decoding then attending in float32: two sequences
    in one call, heads of different lengths, 8/4/3/2-bit keys and values of different widths, residual rows (none in
    one head), 1 to 5 query heads per KV head (the register paths for keys and values take 1 to 4); each query head reads its own
    KV head of its own sequence."""
    from kvmem import kernel
    from kvmem.quant.pack import concat
    from kvmem.rows import KernelRows

    assert kernel.available()  # the build must work here: a silent fall back to PyTorch would hide a broken kernel
    gen = torch.Generator().manual_seed(0)
    d, g = 64, 32
    shapes = [([96, 32, 160], [5, 0, 17]), ([32, 64, 32], [3, 9, 1])]  # per sequence: encoded and residual rows per head
    for (kbits, vbits), groups in zip([(8, 8), (4, 4), (3, 3), (2, 2), (4, 2), (8, 8), (4, 4), (8, 4)], [3, 3, 3, 3, 3, 4, 1, 5]):
        seqs = []
        for lengths, residual in shapes:
            keys, values = ([torch.randn(n, d, generator=gen) for n in lengths] for _ in range(2))
            seqs.append(([quantize(k, kbits, g, dim=0) for k in keys], [quantize(v, vbits, g, dim=1) for v in values],
                         [torch.randn(r, d, generator=gen) for r in residual],
                         [torch.randn(r, d, generator=gen) for r in residual], torch.tensor([0, *lengths]).cumsum(0)))
        query = torch.randn(len(shapes), 3 * groups, d, generator=gen)
        out = kernel.decode_attention(query, [KernelRows(concat(qk, 0), concat(qv, 0), offsets, rk, rv)
                                              for qk, qv, rk, rv, offsets in seqs], 0.125)
        want = torch.stack([torch.cat([torch.softmax(q[groups * h:groups * (h + 1)] @ torch.cat([dequantize(qk[h]), rk[h]]).T
                                                     * 0.125, -1) @ torch.cat([dequantize(qv[h]), rv[h]]) for h in range(3)])
                            for q, (qk, qv, rk, rv, _) in zip(query, seqs)])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    query = torch.randn(2, 9, d, generator=gen)
    # full-precision rows only (an evicted layer's heads of different lengths)
    rows = [KernelRows(None, None, None, *([torch.randn(n, d, generator=gen) for n in (7, 40, 1)] for _ in range(2)))
            for _ in range(2)]
    out = kernel.decode_attention(query, rows, 0.125)
    want = torch.stack([torch.cat([torch.softmax(q[3 * h:3 * h + 3] @ r.residual_keys[h].T * 0.125, -1) @ r.residual_values[h]
                                   for h in range(3)]) for q, r in zip(query, rows)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_gemma"])
@pytest.mark.parametrize("spec", ["kivi-4:group=8:residual=8", "kivi-2:group=8:residual=16", "kivi-3:group=8:residual=8",
                                  "adaquant-k4v2:group=8:residual=8", "kivi-2:group=2:residual=8", None])
def test_decode_steps_read_the_codes_in_place_as_decoded_rows_would(kind, spec, request, monkeypatch):
    """A quantized layer's decode step reads its codes in the kernel, nothing decoded (dense heads, and heads made
    ragged by adaptive budgets; Gemma's sliding layers too, where the window needs no mask): the logits of decoding the
    rows and attending them in PyTorch, up to float summation order. Without quantization (None) the same holds for
    evicted full-precision layers (uniform and adaptive budgets), which PyTorch attends head by head when ragged."""
    import kvmem.kernel as kernel
    from kvmem.layer import KVLayer

    model = request.getfixturevalue(kind)
    ids = random_ids(84, 9)
    calls, in_place = [], kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a: calls.append(1) or in_place(*a))
    for ragged in (False, True):
        _, cache = run(model, ids[:, :76], quant=spec, observe_window=32)
        if ragged:
            compress(cache, get_method("snapkv:budget=adaptive"), 0.5)
            assert any(len(set(layer.lengths())) > 1 for layer in cache.layers)
        elif spec is None:  # an uncompressed layer keeps transformers' SDPA; a uniformly evicted one is read in place
            compress(cache, get_method("snapkv"), 0.5)
        reference = cache.clone()
        calls.clear()
        with torch.no_grad():
            got = torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(76, 84)], 1)
            with monkeypatch.context() as m:
                m.setattr(KVLayer, "_decodes_in_place", lambda self, new_pos, batched=False: False)
                want = torch.cat([model(input_ids=ids[:, i:i + 1], cache=reference, use_cache=True).logits
                                  for i in range(76, 84)], 1)
        if spec and spec.endswith("group=2:residual=8"):  # 2-bit values in groups of 2 channels: not whole bytes, PyTorch's path
            assert not calls
        else:
            assert len(calls) >= 8  # every step read codes in place (in at least one layer)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert cache.kv_bytes() == reference.kv_bytes()


def test_bytes_held_are_the_packed_codes_scales_and_residual(tiny_llama):
    _, cache = run(tiny_llama, random_ids(45, 2), quant="kivi-2:group=8:residual=8")
    # per layer and KV head (2 x 2): 45 rows; the newest 8 and the 5 that do not fill a block stay in float32
    encoded, residual, d = 32, 13, 16
    codes = 2 * encoded * d * 2 // 8  # keys and values at 2 bits
    scales = 2 * 2 * (encoded // 8 * d + encoded * d // 8)  # fp16 scale + zero: keys per channel, values per token
    assert cache.kv_bytes() == 2 * 2 * (codes + scales + 2 * residual * d * 4)
    # every position is held: the model's own causal mask serves (no (Q, T) mask per head at long prefills)
    assert not any(layer.compressed for layer in cache.layers)


def test_bytes_held_by_joined_codes_are_the_bytes_held_head_by_head():
    """Heads of different lengths, codes joined for the kernel, decode steps flushing blocks: the joined tensors
    `kv_tensors` lists hold exactly the storages every head's codes are views of (nothing missed, nothing twice)."""
    from kvmem.cache import storage_bytes
    from kvmem.quant.base import QuantizedRows

    g = torch.Generator().manual_seed(0)
    n = (70, 41, 99)
    rows = QuantizedRows.of(get_scheme("kivi-4:group=8:residual=8"), [torch.randn(k, 16, generator=g) for k in n],
                            [torch.randn(k, 16, generator=g) for k in n], [torch.arange(k, dtype=torch.int32) for k in n])
    for step in range(20):
        rows._joined(stacked=False)
        per_head = [t for q in (*rows.qk, *rows.qv) if q is not None for t in q.tensors()] + rows.res.kv_tensors()
        assert storage_bytes(rows.kv_tensors()) == storage_bytes(per_head)
        rows.append(torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g),
                    torch.tensor([200 + step], dtype=torch.int32))
        rows.flush()
    assert [len(p) for p in rows.positions()] == [k + 20 for k in n]


def test_quantization_composes_with_eviction_and_generate(tiny_llama):
    ids = random_ids(80, 3)
    _, cache = run(tiny_llama, ids, quant="kivi-4:group=8:residual=8", observe_window=32)
    before = cache.kv_bytes()
    compress(cache, get_method("snapkv"), 0.25)
    assert cache.tokens_held()[0] == [20, 20] and cache.kv_bytes() < before
    with torch.no_grad():
        assert torch.isfinite(tiny_llama(input_ids=random_ids(3, 4), cache=cache, use_cache=True).logits).all()
    generated = KVCache(tiny_llama.config, compressor=Compressor(get_method("knorm"), 0.5),
                        quant=get_scheme("kivi-4:group=8:residual=8"))
    out = tiny_llama.generate(input_ids=ids, cache=generated, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 84 and generated.tokens_held()[0] == [43, 43]  # 40 kept + 3 fed back


def test_quantized_sliding_layers_keep_blocks_and_mask_what_expired(tiny_gemma):
    """Window 8, blocks of 8: a sliding layer holds at most window - 1 visible rows plus a partly expired block."""
    ids = random_ids(64, 5)
    full, _ = run(tiny_gemma, ids, chunks=16)
    q8, cache = run(tiny_gemma, ids, chunks=16, quant="kivi-8:group=8:residual=0")
    torch.testing.assert_close(q8, full, atol=2e-2, rtol=0)
    assert max(cache.layers[0].lengths()) < 7 + 8


def test_bad_schemes_are_named_errors(tiny_llama):
    with pytest.raises(KVMemError, match="unknown quantization scheme"):
        get_scheme("kivi-5")
    with pytest.raises(KVMemError, match="residual"):
        get_scheme("kivi-2:residual=40")
    with pytest.raises(KVMemError, match="head_dim 16"):
        KVCache(tiny_llama.config, quant=get_scheme("kivi-2"))  # groups of 32 channels in a head of 16


def test_quantized_rows_export_and_import_exactly_as_held(tiny_llama):
    """The chunk store's unit: encoded rows leave and come back bit for bit (no decode, no re-encode), and a
    layer of another scheme, or raw, refuses them by name."""
    from kvmem.rows import ExportedRows

    spec = "kivi-2:group=8:residual=8"
    ids = random_ids(45, 6)
    _, source = run(tiny_llama, ids, quant=get_scheme(spec))
    exported = [layer.export_rows() for layer in source.layers]
    assert exported[0].codec == spec and "k.packed" in exported[0].heads[0] and "keys" not in exported[0].heads[0]
    target = KVCache(tiny_llama.config, quant=get_scheme(spec))
    for layer, rows in zip(target.layers, exported):
        layer.import_rows(rows)
    assert target.kv_bytes() == source.kv_bytes()
    for a, b in zip(source.layers, target.layers):
        for (ka, va, pa), (kb, vb, pb) in zip(a.rows.heads(), b.rows.heads()):
            assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(pa, pb)
    nxt = random_ids(2, 7)
    with torch.no_grad():
        torch.testing.assert_close(tiny_llama(input_ids=nxt, cache=target, use_cache=True).logits,
                                   tiny_llama(input_ids=nxt, cache=source, use_cache=True).logits, atol=0, rtol=0)
    with pytest.raises(KVMemError, match="holds raw rows"):
        KVCache(tiny_llama.config).layers[0].import_rows(exported[0])
    with pytest.raises(KVMemError, match="this layer holds 'kivi-4:group=8:residual=8'"):
        KVCache(tiny_llama.config, quant=get_scheme("kivi-4:group=8:residual=8")).layers[0].import_rows(exported[0])
    short = ExportedRows([{**h, "positions": h["positions"][:-1]} for h in exported[0].heads], exported[0].codec,
                         exported[0].meta)
    with pytest.raises(KVMemError, match="do not add up"):
        KVCache(tiny_llama.config, quant=get_scheme(spec)).layers[0].import_rows(short)
    headless = ExportedRows([{k: v for k, v in h.items() if k != "residual_keys"} for h in exported[0].heads],
                            exported[0].codec, exported[0].meta)
    with pytest.raises(KVMemError, match="lacks"):
        KVCache(tiny_llama.config, quant=get_scheme(spec)).layers[0].import_rows(headless)
    forged = ExportedRows(exported[0].heads, exported[0].codec,
                          {**exported[0].meta, "heads": [{**m, "k.__type": "os.system"} for m in exported[0].meta["heads"]]})
    with pytest.raises(KVMemError, match="unknown type"):
        KVCache(tiny_llama.config, quant=get_scheme(spec)).layers[0].import_rows(forged)


def test_heads_of_different_lengths_encode_their_blocks_together_with_a_bounded_residual():
    """Heads evicted to different lengths fill their blocks at different steps; a decode step's flush waits until
    every head has a block (or one has two), so the heads are encoded in one pass, and no residual passes
    residual + 2 * group - 1 rows. Every row stays, in order."""
    from kvmem.quant.base import QuantizedRows
    from kvmem.quant.kivi import KIVI

    scheme, d = KIVI(4), 64
    lengths = [130, 151, 200, 3]  # residual 128, group 32: one head has a block, one has two, one has none
    keys = [torch.randn(n, d) for n in lengths]
    rows = QuantizedRows.of(scheme, keys, [k + 1 for k in keys], [torch.arange(n, dtype=torch.int32) for n in lengths])
    flushes = []
    for step in range(200):
        encoded = [p.numel() for p in rows.pq]
        new = torch.randn(len(lengths), 1, d)
        rows.append(new, new + 1, torch.tensor([1000 + step], dtype=torch.int32))
        rows.flush()
        grew = [p.numel() > e for p, e in zip(rows.pq, encoded)]
        if any(grew):
            flushes.append(grew)
        assert max(rows.res.lengths()) <= scheme.residual + 2 * scheme.group - 1
    assert rows.lengths() == [n + 200 for n in lengths]
    first_together = [all(g) for g in flushes].index(True)  # before it, the short head had no block yet
    assert first_together > 0 and all(all(g) for g in flushes[first_together:])
    assert len(flushes) <= 200 // scheme.group + 2  # head by head would be about 3x as many
    for (k, _, p), n in zip(rows.heads(), lengths):
        assert torch.equal(p[-200:], torch.arange(1000, 1200, dtype=torch.int32)) and k.shape[0] == n + 200


@pytest.mark.parametrize("spec", ["kivi-8", "kivi-4", "kivi-2"])
def test_kivi_encodes_every_head_in_one_pass_as_head_by_head(spec):
    """A flush encodes all heads at once (`encode_heads`): the same codes, scales and zero-points as one head at a time."""
    scheme = get_scheme(spec)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 64, 64, generator=gen), torch.randn(3, 64, 64, generator=gen) * 4
    p = torch.arange(64, dtype=torch.int32).expand(3, 64)
    together = scheme.encode_heads(k, v, p)
    for h, (kq, vq) in enumerate(together):
        for a, b in zip((kq, vq), scheme.encode(k[h], v[h], p[h], h)):
            assert (a.dim, a.shape, a.group, a.bits) == (b.dim, b.shape, b.group, b.bits)
            assert torch.equal(a.packed, b.packed) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)

"""Every quantization scheme composes with eviction on both model families (Gemma-3's sliding layers too), from
the API and the CLI. Calibrated schemes are fitted here on a short stretch of text (their `sequences=` and
`length=` options), so the paths run end to end without the benchmark's longer fits."""

from __future__ import annotations

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.compress import METHODS, Compressor, ModelContext, compress, get_method
from kvmem.forward import feed
from kvmem.generate import answer, new_cache
from kvmem.quant import SCHEMES, get_scheme

QUICK = {  # the registered schemes, calibrated ones on 1 x 128 tokens
    "kivi-2": "kivi-2:residual=0", "adaquant-k4v2": "adaquant-k4v2:residual=0", "mikv": "mikv",
    "kvquant-2": "kvquant-2:sequences=1:length=128", "rotatekv-2": "rotatekv-2:sequences=1:length=128",
    "cq-2": "cq-2:sequences=1:length=128:samples=256:iters=4",
}
CONTEXT = ("Ada Lovelace wrote the first program for the Analytical Engine in 1843. The engine was designed by "
           "Charles Babbage in London. It was never completed. ") * 8


def test_every_scheme_family_is_exercised():
    family = lambda name: name.split("-")[0]  # noqa: E731  (kivi-2 -> kivi, adaquant-k4v2 -> adaquant)
    assert {family(name) for name in SCHEMES} == {family(name) for name in QUICK}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("scheme", list(QUICK))
def test_scheme_composes_with_eviction_on_both_families(model, scheme, request):
    lm = request.getfixturevalue(model)
    spec = QUICK[scheme]
    method = ["snapkv", "keydiff", "streaming-llm:budget=razor", "kvzip", "tova", "h2o"][list(QUICK).index(scheme)]
    plain = answer(lm, CONTEXT, "Who designed the engine?", method, 0.5, max_new_tokens=6)
    quantized = answer(lm, CONTEXT, "Who designed the engine?", method, 0.5, max_new_tokens=6, quant=spec)
    assert quantized.tokens and quantized.kv_bytes < plain.kv_bytes
    # and inside model.generate, compressing layer by layer as the model runs
    prepared = get_scheme(spec, lm)
    ids = lm.tokenizer(CONTEXT, return_tensors="pt").input_ids
    cache = KVCache(lm.model.config, quant=prepared, compressor=Compressor(get_method("knorm"), 0.25))
    out = lm.model.generate(input_ids=ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    held = sum(map(sum, cache.tokens_held()))
    full = KVCache(lm.model.config)
    with torch.no_grad():
        feed(lm, full, ids[0].tolist() + out[0, -3:-1].tolist())
    if scheme == "mikv":  # no token left behind: every row stays, the evicted ones at low precision
        assert held == sum(map(sum, full.tokens_held())) and cache.kv_bytes() < full.kv_bytes() / 3
    else:
        assert held < 0.5 * sum(map(sum, full.tokens_held()))


def test_every_method_composes_with_a_quantized_cache(smollm2):
    ids = smollm2.tokenizer(CONTEXT, return_tensors="pt").input_ids[0].tolist()
    base = KVCache(smollm2.model.config, track_attention=True)
    with torch.no_grad():
        feed(smollm2, base, ids)
    for name in METHODS:
        if name == "full":
            continue
        cache = base.clone()
        if METHODS[name].decode_phase:  # it compresses generated rows: a cache of its own that has decoded a few
            cache = new_cache(smollm2, get_method(name))
            with torch.no_grad():
                feed(smollm2, cache, ids[:-8])
                for t in ids[-8:]:
                    feed(smollm2, cache, [t])
        compress(cache, get_method(name), 0.25, context=ModelContext(smollm2, ids))
        raw = cache.clone()
        cache.quantize(get_scheme("kivi-4:residual=32"))
        with torch.no_grad():
            logits = feed(smollm2, cache, ids[-1:])
            feed(smollm2, raw, ids[-1:])
        # like for like: both hold this token and room for the next ones (raw buffers grow by 64 rows, a quantized
        # residual by one block)
        assert torch.isfinite(logits).all() and cache.kv_bytes() < raw.kv_bytes(), name


def test_cli_generate_with_a_calibrated_scheme(tmp_path):
    from typer.testing import CliRunner

    from kvmem.cli import app

    doc = tmp_path / "doc.txt"
    doc.write_text(CONTEXT)
    result = CliRunner().invoke(app, ["generate", "--context-file", str(doc), "--prompt", "Who designed the engine?",
                                      "--method", "snapkv", "--keep-ratio", "0.5", "--quant", QUICK["kvquant-2"],
                                      "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert "kvquant-2:sequences=1:length=128" in result.output and "KV held" in result.output


@pytest.mark.parametrize("scheme", ["kvquant-2", "rotatekv-2", "cq-2"])
def test_all_heads_at_once_encode_and_decode_exactly_as_head_by_head(scheme, smollm2):
    """Schemes that encode and decode every head of a layer in one pass (fewer, larger ops: a decode step reads
    every layer's whole history) give bit for bit what their per-head `encode` / `decode` give, with the heads
    at the same positions and at their own (as after per-head eviction)."""
    from kvmem.quant.base import Scheme

    prepared = get_scheme(QUICK[scheme], smollm2)
    assert type(prepared).decode_heads is not Scheme.decode_heads  # (rotatekv encodes blocks of 32 rows head by head)
    assert scheme == "rotatekv-2" or type(prepared).encode_heads is not Scheme.encode_heads
    ids = smollm2.tokenizer(CONTEXT, return_tensors="pt").input_ids[0].tolist()
    full = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, full, ids)
    view = prepared.for_layer(3)
    heads = full.layers[3].rows.heads()
    keys, values = torch.stack([k for k, _, _ in heads]), torch.stack([v for _, v, _ in heads])
    same = torch.stack([p for _, _, p in heads])
    own = same + 7 * torch.arange(len(heads), dtype=torch.int32)[:, None]  # other positions per head
    for positions in (same, own):
        together = view.encode_heads(keys, values, positions)
        alone = [view.encode(k, v, p, h) for h, (k, v, p) in enumerate(zip(keys, values, positions))]
        for pair_a, pair_b in zip(together, alone):
            for a, b in zip(pair_a, pair_b):
                assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))
        out = [torch.empty_like(keys) for _ in range(4)]
        view.decode_heads([k for k, _ in together], [v for _, v in together], list(positions), out[0], out[1])
        Scheme.decode_heads(view, [k for k, _ in alone], [v for _, v in alone], list(positions), out[2], out[3])
        assert torch.equal(out[0], out[2]) and torch.equal(out[1], out[3])
        assert (out[0] - keys).abs().max() > 1e-3  # the rows really went through the codes

"""The quantization benchmark's pieces: Delta-ppl with its block bootstrap, bytes of HF's quantized caches,
caches built from prefilled rows, the task cells and the report (no timing goals here)."""

from __future__ import annotations

import math

import pytest
import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem_bench.perplexity import delta_ppl, token_nlls
from kvmem_bench.quant import FULL
from kvmem_bench.quant.caches import from_rows, held_bytes, kv_elements
from kvmem_bench.quant.report import hf_peer, ppl_rows, task_rows, write_report
from kvmem_bench.quant.runner import QuantConfig, task_cells
from kvmem_bench.readme import update_readme
from kvmem.forward import feed
from kvmem.quant import get_scheme


def test_delta_ppl_is_zero_for_identical_nlls_and_follows_a_shift():
    base = [2.0 + 0.1 * math.sin(i) for i in range(256)]
    assert delta_ppl([(base, base)], 32) == (0.0, 0.0, 0.0)
    est, lo, hi = delta_ppl([([x + 0.01 for x in base], base)], 32)
    assert est == pytest.approx(100 * (math.exp(0.01) - 1)) and lo <= est <= hi
    noisy = [x + (0.05 if i % 2 else -0.03) for i, x in enumerate(base)]
    est, lo, hi = delta_ppl([(noisy, base), (noisy, base)], 32)
    assert est == pytest.approx(100 * (math.exp(0.01) - 1), rel=1e-6) and lo < hi


def test_hf_quantized_cache_bytes_are_its_packed_tensors(smollm2):
    ids = list(range(200, 264))
    full = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, full, ids)
    q4, q2 = (from_rows(smollm2, full, name, {}) for name in ("hf-quanto-4", "hf-quanto-2"))
    fp8 = from_rows(smollm2, full, "hf-fp8", {})
    elements = kv_elements(smollm2, full)
    assert kv_elements(smollm2, q4) == elements
    assert held_bytes(fp8) == elements + 30 * 2 * 4  # one byte per element, plus a float32 scale per layer for K and V
    # codes at 4 and 2 bits per element plus scales and shifts: less than float32, and 2 bits below 4
    assert held_bytes(q2) < held_bytes(q4) < full.kv_bytes() / 4
    assert held_bytes(q2) > elements * 2 / 8


def test_from_rows_holds_the_scheme_and_feeds_on(smollm2):
    ids = list(range(300, 600))  # past the 128-token full-precision residual
    full = KVCache(smollm2.model.config)
    with torch.no_grad():
        feed(smollm2, full, ids)
        cache = from_rows(smollm2, full, "kivi-2", {})
        assert cache.kv_bytes() < 0.6 * full.kv_bytes() and full.layers[0].quant is None  # the source is untouched
        direct = KVCache(smollm2.model.config, quant=get_scheme("kivi-2"))
        feed(smollm2, direct, ids)
        assert cache.kv_bytes() == direct.kv_bytes()  # the same rows a quantized prefill would have encoded
        nll_q = token_nlls(smollm2, cache, list(range(600, 633)), 32)
        nll_f = token_nlls(smollm2, full.clone(), list(range(600, 633)), 32)
    assert nll_q != nll_f and all(math.isfinite(x) for x in nll_q)


def test_task_cells_cross_eviction_with_quantization():
    cfg = QuantConfig(models=["smollm2-135m"], schemes=["kivi-2", "kivi-8", "hf-quanto-2", "hf-quanto-2-kivi"],
                      task_methods=["keydiff"], task_ratios=[0.5, 0.25])
    cells = task_cells(cfg)
    assert cells[0] == ("full", 1.0, FULL)
    assert ("full", 1.0, "hf-quanto-2") in cells and ("full", 1.0, "hf-quanto-2-kivi") not in cells
    assert ("keydiff", 0.25, "kivi-2") in cells and ("keydiff", 0.25, FULL) in cells
    assert ("keydiff", 0.5, "kivi-8") not in cells and ("keydiff", 0.5, "hf-quanto-2") not in cells
    with pytest.raises(KVMemError, match="unknown quantization scheme"):
        QuantConfig(models=["smollm2-135m"], schemes=["kivi-5"]).validate()
    with pytest.raises(KVMemError, match="unknown HF baseline 'hf-quanto-3'"):
        QuantConfig(models=["smollm2-135m"], schemes=["hf-quanto-3"]).validate()
    with pytest.raises(KVMemError, match="part"):
        QuantConfig(models=["smollm2-135m"], parts=["speed"]).validate()


def test_hf_peer_is_the_same_bits():
    assert hf_peer("kivi-2") == "hf-quanto-2-kivi" and hf_peer("kivi-4") == "hf-quanto-4-kivi"
    assert hf_peer("kivi-8") == "hf-fp8" and hf_peer("kivi-3") is None and hf_peer("hf-quanto-2") is None


def test_report_from_records(tmp_path):
    out = tmp_path / "quant"  # results/quant, as the README block reads it
    out.mkdir()
    import json

    nll = [2.0] * 63
    recs = [dict(part="ppl", model="m", scheme=s, text=t, length=64, chunk=32, nll=[x + d for x in nll], seconds=1.0,
                 kv_bytes=b, elements=1000) for t in range(2) for s, d, b in ((FULL, 0.0, 4000), ("kivi-2", 0.02, 400))]
    for i in range(12):
        for cell, method, ratio, scheme, score, b in ((FULL, "full", 1.0, FULL, 1.0, 1000),
                                                      ("keydiff@0.25 + kivi-2", "keydiff", 0.25, "kivi-2", 1.0, 90),
                                                      ("kivi-2", "full", 1.0, "kivi-2", float(i % 2), 300)):
            recs.append(dict(part="tasks", model="m", length=64, task="t", sample=i, cell=cell, method=method,
                             keep_ratio=ratio, scheme=scheme, score=score, output="", kv_bytes=b, kv_bytes_full=1000))
        for cell, method, ratio, scheme, score, b in ((FULL, "full", 1.0, FULL, 1.0, 1000),  # a model with no 10x hit
                                                      ("keydiff@0.25 + kivi-2", "keydiff", 0.25, "kivi-2", 0.0, 90),
                                                      ("kivi-2", "full", 1.0, "kivi-2", 1.0, 300)):
            recs.append(dict(part="tasks", model="m2", length=64, task="t", sample=i, cell=cell, method=method,
                             keep_ratio=ratio, scheme=scheme, score=score, output="", kv_bytes=b, kv_bytes_full=1000))
        # the aware setting: its own table, never in the agnostic one's cells, its frontier or its target
        for cell, method, ratio, scheme, score, b in ((FULL, "full", 1.0, FULL, 1.0, 1100),
                                                      ("keydiff@0.25 + kivi-2", "keydiff", 0.25, "kivi-2", 0.0, 95)):
            recs.append(dict(part="tasks", model="m", length=64, task="t", sample=i, setting="aware", cell=cell,
                             method=method, keep_ratio=ratio, scheme=scheme, score=score, output="", kv_bytes=b,
                             kv_bytes_full=1100))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    summary = write_report(out)
    row = next(r for r in summary["ppl"] if r["scheme"] == "kivi-2")
    assert row["delta_pct"][0] == pytest.approx(100 * (math.exp(0.02) - 1)) and row["factor"] == 10.0
    tasks = {r["cell"]: r for r in task_rows(recs) if r["model"] == "m" and r["setting"] == "agnostic"}
    assert tasks["kivi-2"]["vs_full"][2] < 0  # 0.5 below the full cache, significant on 12 samples
    assert tasks["keydiff@0.25 + kivi-2"]["score"][0] == 1.0 and tasks[FULL]["n"] == 12
    aware = {r["cell"]: r for r in task_rows(recs) if r["model"] == "m" and r["setting"] == "aware"}
    assert aware["keydiff@0.25 + kivi-2"]["score"][0] == 0.0 and aware["keydiff@0.25 + kivi-2"]["vs_full"][0] == -1.0
    report = (out / "report.md").read_text()
    assert "**m @ 64 tokens**, aware" in report and "**m @ 64 tokens**, agnostic" in report
    assert "keydiff@0.25 + kivi-2 ★" in report and "| kivi-2 | 12 |" in report and "kivi-2 ★" not in report.replace(
        "keydiff@0.25 + kivi-2 ★", "")
    assert (out / "frontier.png").exists() and ppl_rows(recs)[0]["scheme"] == FULL
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- quant: old -->\nstale\n<!-- /quant -->\nafter\n")
    update_readme("quant", readme=readme, results=tmp_path)
    text = readme.read_text()
    assert "stale" not in text and "## Targets" not in text
    assert text.startswith("intro\n<!-- quant: regenerated") and text.endswith("<!-- /quant -->\nafter\n")
    assert "keydiff@0.25 + kivi-2 (11.1x" in text  # the target line, regenerated from the records
    assert "m2 @ 64: not met (at ≥ 95% the most is 3.3x, kivi-2)" in text  # per model, what it reached instead

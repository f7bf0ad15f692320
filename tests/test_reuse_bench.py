"""The reuse benchmark end to end on a short prompt (its records, the report's tables and goals, the README block)
and its bad input. No timing goals here: speedups are what the committed report measures."""

from __future__ import annotations

import json

import pytest

from kvmem.errors import KVMemError
from kvmem_bench.reuse.runner import ReuseConfig, run_length
from kvmem_bench.readme import update_readme
from kvmem_bench.reuse.report import write_report



def test_a_document_past_gemma3s_sliding_window_is_reused_whole(gemma3, tmp_path):
    """The chunks stored are the ones a store's first request computed: a sliding layer's rows of an early chunk
    (gone from the cache once the document is longer than its window) are in them, so the warm request reuses
    the whole document instead of discarding every chunk."""
    cfg = ReuseConfig(models=["gemma3-270m"], lengths=[704], codecs=["raw"], tiers=["memory"], repeats=1,
                      continuation=16, out=tmp_path)
    run_length(gemma3, "gemma3-270m", 704, cfg, None, log=lambda *_: None)
    warm = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    warm = [r for r in warm if r["kind"] == "warm"]
    assert len(warm) == 1 and warm[0]["reused_tokens"] == 704 - 64 and warm[0]["computed_tokens"] > 0


def test_a_short_run_records_every_tier_and_codec_and_reports_them(smollm2, tmp_path, redis_server):
    out = tmp_path / "reuse"  # results/reuse, as the README block reads it
    out.mkdir()
    cfg = ReuseConfig(models=["smollm2-135m"], lengths=[320], codecs=["raw", "quant:kivi-8"], repeats=1, continuation=32,
                      out=out)
    cfg.validate()
    run_length(smollm2, "smollm2-135m", 320, cfg, redis_server.url, log=lambda *_: None)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["kind"] == "warm"]
    assert {(r["tier"], r["codec"]) for r in warm} == {(t, c) for t in ("memory", "disk", "redis") for c in ("raw", "quant:kivi-8")}
    assert all(r["reused_tokens"] == 320 - 64 and r["computed_tokens"] > 0 for r in warm)  # the whole document
    sequential = {(r["tier"], r["codec"]) for r in records if r["kind"] == "warm-sequential"}  # the same run, every layer first
    assert sequential == {(r["tier"], r["codec"]) for r in warm}
    codecs = {r["codec"]: r for r in records if r["kind"] == "codec"}
    assert codecs["quant:kivi-8"]["bytes"] < codecs["raw"]["bytes"] / 3
    report = write_report(out).read_text()
    assert "| smollm2-135m | 320 |" in report and "quant:kivi-8" in report and "## Goals" in report
    assert "## Layer-wise pipelining" in report and "| smollm2-135m | 320 | redis | raw |" in report
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    update_readme("reuse", readme=readme, results=tmp_path)
    update_readme("reuse", readme=readme, results=tmp_path)  # replaces its block, does not add another
    assert readme.read_text().count("<!-- reuse:") == 1 and "best TTFT speedup per tier" in readme.read_text()


def test_bad_settings_are_named():
    for kwargs, match in ((dict(codecs=["zip"]), "unknown codec"), (dict(tiers=["tape"]), "unknown tier"),
                          (dict(codecs=["quant:kivi-8"]), "needs the raw codec"), (dict(parts=("speed",)), "unknown reuse part")):
        with pytest.raises(KVMemError, match=match):
            ReuseConfig(models=["smollm2-135m"], **kwargs).validate()


def test_similar_scenario_helpers():
    """The semshare scenario's quality measures and prompt variants (kvmem_bench.reuse.semantic)."""
    from kvmem_bench.reuse.semantic import rouge_l, summarize_similar, token_f1, variant

    assert rouge_l("a b c d", "a b c d") == 1.0 and rouge_l("a b", "c d") == 0.0
    assert abs(rouge_l("a x b c", "a b c y") - 0.75) < 1e-9  # LCS a b c: 2 * 3 / (4 + 4)
    assert abs(token_f1("the cat the", "the dog") - 0.4) < 1e-9  # one shared "the": 2 * 1 / (3 + 2)
    doc = "One two. Three four. Five six. Seven eight"
    assert variant(doc, "reordered", 0) == "Five six. Seven eight. One two. Three four"
    assert variant(doc, "sentence inserted", 0).endswith(doc)
    long = " ".join(f"w{i}" for i in range(36))
    changed = variant(long, "words changed", 0).split()
    assert len(changed) == 36 and 1 <= sum(a != b for a, b in zip(changed, long.split())) <= 3  # one word in twelve
    records = [dict(pair=p, model="m", embedder="e", variant="reordered", method=m, prompt_tokens=10, reused_tokens=r,
                    compute_fraction=1.0, speedup=s, ttft_s=1.0, exact=e, rouge_l=q, token_f1=q)
               for p in range(3) for m, r, s, e, q in (("cold", 0, 1.0, True, 1.0), ("recycling", 2, 0.9, True, 1.0),
                                                       ("semshare@0.15", 6, 1.5, False, 0.5))]
    rows = {(r["method"], r["variant"]): r for r in summarize_similar(records)["rows"]}
    mine = rows[("semshare@0.15", "all")]
    assert mine["reused_tokens"] == 6 and mine["exact"][0] == 0.0 and mine["rouge_l_vs_recycling"][0] == -0.5
    assert mine["speedup"][0] == 1.5 and rows[("recycling", "all")]["rouge_l"][0] == 1.0


def test_codec_frontier_records_bytes_and_quality_and_reports_them(smollm2, tmp_path):
    """The codec-frontier part end to end on two short documents: a record per (document, codec) with the stored
    bytes and the continuation's NLLs, a table row per codec with its ratio to kivi-8's bytes and Δppl vs raw,
    the verdict lines and the plot."""
    from kvmem_bench.reuse.frontier import run_frontier, summarize_frontier
    from kvmem_bench.records import read_records

    codecs = ["quant:kivi-2", "cachegen:delta=none:key_bins=0.6+0.6+0.6:value_bins=0.6+0.6+0.6"]  # canonical specs
    path = run_frontier(smollm2, "smollm2-135m", tmp_path, codecs, docs=2, length=256, continuation=32,
                        log=lambda *_: None)
    records = [r for r in read_records(path) if r["kind"] == "frontier"]
    anatomy = {r["spec"]: r for r in read_records(path) if r["kind"] == "frontier-anatomy"}
    assert set(anatomy) == {"cachegen", "cachegen:delta=none:key_bins=0.3+0.3+0.3:value_bins=1+1+1"}
    parts = anatomy["cachegen"]["bytes_per_token"]
    assert parts["stream"] > 0.5 * sum(parts.values()) and parts["k_hist"] > 0 and parts["k_scale"] > 0
    assert all(0 < b < 8 for b in anatomy["cachegen"]["entropy_bits"].values())
    assert {(r["doc"], r["codec"]) for r in records} == {(d, c) for d in (0, 1) for c in ["raw", "quant:kivi-8", *codecs]}
    assert all(len(r["nll"]) == 32 and r["tokens"] == 256 for r in records)
    run_frontier(smollm2, "smollm2-135m", tmp_path, codecs, docs=2, length=256, continuation=32, log=lambda *_: None)
    assert len(read_records(path)) == len(records) + len(anatomy)  # resumed: nothing measured twice
    rows = {r["codec"]: r for r in summarize_frontier(records)["smollm2-135m/256/32"]}
    assert rows["raw"]["dppl"] is None and rows["quant:kivi-8"]["vs_kivi8"] == 1.0
    assert rows["quant:kivi-2"]["vs_kivi8"] < 0.5 and rows["quant:kivi-2"]["dppl"][0] > 0  # 2 bits cost perplexity
    assert rows[codecs[1]]["docs"] == 2 and rows[codecs[1]]["scored_tokens"] == 64
    report = write_report(tmp_path).read_text()
    assert "## Codec frontier" in report and f"| smollm2-135m | {codecs[1]} | 2 × 32 |" in report
    assert "smallest cachegen with upper CI bound" in report and (tmp_path / "codec_frontier.png").exists()


def test_frontier_verdict_uses_the_bound_asked_for():
    from kvmem_bench.reuse.frontier import best_under_target

    rows = [dict(codec="cachegen:a", bytes_per_token=10, dppl=[0.8, 0.2, 1.4], docs=12),
            dict(codec="cachegen:b", bytes_per_token=20, dppl=[0.5, 0.1, 0.9], docs=12),
            dict(codec="cachegen:c", bytes_per_token=5, dppl=[0.1, -0.9, 0.8], docs=2),  # left after 2 documents
            dict(codec="quant:kivi-2", bytes_per_token=5, dppl=[0.1, 0.0, 0.2], docs=12)]  # not cachegen: never the answer
    assert best_under_target(rows, "upper")["codec"] == "cachegen:b"
    assert best_under_target(rows, "point")["codec"] == "cachegen:a"
    assert best_under_target(rows[3:]) is None

"""The reuse benchmark end to end on a short prompt (its records, the report's tables and goals, the README block)
and its bad input. No timing goals here: speedups are what the committed report measures."""

from __future__ import annotations

import json

import pytest

from kvmem.errors import KVMemError
from kvmem_bench.reuse.runner import ReuseConfig, run_length
from kvmem_bench.readme import update_readme
from kvmem_bench.reuse.report import write_report



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
    codecs = {r["codec"]: r for r in records if r["kind"] == "codec"}
    assert codecs["quant:kivi-8"]["bytes"] < codecs["raw"]["bytes"] / 3
    report = write_report(out).read_text()
    assert "| smollm2-135m | 320 |" in report and "quant:kivi-8" in report and "## Goals" in report
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

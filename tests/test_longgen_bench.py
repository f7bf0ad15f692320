"""The long-output benchmark (issue 35): its copy check, its measures, a short run end to end on SmolLM2 (records,
report, README block) and its bad input. No timing goals here."""

from __future__ import annotations

import json

import pytest

from kvmem.errors import KVMemError
from kvmem_bench.longgen.copy import copy_sample, copy_score
from kvmem_bench.longgen.report import lcs_fraction, repeated_4grams, write_report
from kvmem_bench.longgen.runner import LongGenConfig, run_longgen_suite
from kvmem_bench.readme import update_readme


def test_the_copy_check_counts_entries_written_whole_whatever_the_numbering():
    _, _, entries = copy_sample(3)
    assert len(entries) == len(set(entries)) == 24 and copy_sample(3)[2] == entries  # deterministic
    lines = [f"{k + 1}. {e}" for k, e in enumerate(entries[:12])] + [f"{k + 13} {e.upper()}" for k, e in enumerate(entries[12:18])]
    assert copy_score(entries, "\n".join(lines)) == 18 / 24
    wrong_number = entries[0][:-1] + ("0" if entries[0][-1] != "0" else "1")
    assert copy_score(entries, f"1. {wrong_number}\n2) {entries[1]}\n- 3: {entries[2]}") == 2 / 24
    assert copy_score(entries, " ".join(entries)) == 0.0  # on one line: not a list


def test_fidelity_and_repetition_measures():
    assert lcs_fraction([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert lcs_fraction([1, 9, 3], [1, 2, 3, 4]) == 0.5
    assert lcs_fraction([], [1, 2]) == 0.0
    assert repeated_4grams(list(range(10))) == 0.0
    assert repeated_4grams([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)


def test_a_short_run_records_both_parts_and_reports_them(smollm2, tmp_path):
    out = tmp_path / "longgen"
    cfg = LongGenConfig(model="smollm2-135m", methods=["h2o"], ratios=[0.25], every=4, extra_rows=16, samples=1, texts=1,
                        context=128, continuation=24, out=out)
    run_longgen_suite(smollm2, cfg, log=lambda *_: None)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {(r["part"], r["method"]) for r in records} == {(p, m) for p in ("copy", "ppl") for m in ("full", "h2o")}
    copy = {r["method"]: r for r in records if r["part"] == "copy"}
    assert copy["h2o"]["mean_kv_bytes"] < 0.5 * copy["full"]["mean_kv_bytes"]  # measured, while decoding
    assert len(copy["full"]["tokens"]) > 100 and copy["full"]["list_tokens"] >= 256
    ppl = [r for r in records if r["part"] == "ppl"]
    assert all(len(r["nll"]) == 24 for r in ppl)
    run_longgen_suite(smollm2, cfg, log=lambda *_: None)  # resumes: nothing run twice
    assert len((out / "records.jsonl").read_text().splitlines()) == len(records)
    cfg.extra_rows = 32  # another setting: its own h2o runs, the full cache's are shared
    run_longgen_suite(smollm2, cfg, log=lambda *_: None)
    assert len((out / "records.jsonl").read_text().splitlines()) == len(records) + 2
    report = write_report(out).read_text()
    assert "| h2o @ 0.25 |" in report and "## Streaming perplexity" in report and (out / "longgen.png").exists()
    assert "prompt kept + 16 rows" in report and "prompt kept + 32 rows" in report
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    update_readme("longgen", readme=readme, results=tmp_path)
    assert readme.read_text().count("<!-- longgen:") == 1 and "Copy a 24-entry list" in readme.read_text()


@pytest.mark.parametrize("kwargs, match", [
    (dict(parts=["essay"]), "unknown part 'essay'"),
    (dict(ratios=[1.0], extra_rows=0), "keep ratio must be in"),
    (dict(extra_rows=-3), "extra_rows"),
    (dict(every=0), "every must be"),
    (dict(methods=["kvzip"]), "needs the model"),
    (dict(methods=["snapkv:budget=global"]), "compares heads of all layers"),
    (dict(methods=["nope"]), "nope"),
])
def test_bad_settings_are_named(kwargs, match):
    with pytest.raises(KVMemError, match=match):
        LongGenConfig(model="smollm2-135m", **kwargs).validate()

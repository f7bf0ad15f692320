"""The continuous-batching benchmark's arithmetic (`kvmem_bench.batching.report`) on runs made up here."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvmem_bench.batching.report import (memory_targets, score_verdict, suite_score, summary, sweep_targets, throughput, throughput_ratio,
                                        window_tokens, write_report)


def run(server: str, tokens_per_s: float, clients: int = 16, duration: float = 60.0, length: int = 1024, **extra) -> dict:
    """A run whose requests stream one token a chunk at a steady `tokens_per_s` in all, 64 tokens a request."""
    gap = clients / tokens_per_s  # each client's chunks
    requests = []
    for c in range(clients):
        t = 0.0
        while t < duration:
            times = [round(0.5 + i * gap, 4) for i in range(64)]
            requests.append(dict(status="ok", t_start_s=t, t_end_s=t + times[-1], ttft_s=times[0], chunk_s=times,
                                 completion_tokens=64, cached_tokens=900, latency_s=times[-1]))
            t += times[-1]
    return dict(phase="sweep", server=server, clients=clients, duration_s=duration, length=length, prompt_tokens=925,
                requests=requests, metrics=[[1.0, clients, 1e6, 0.0]], **extra)


def test_windows_count_the_tokens_streamed_in_each():
    r = run("kvmem-batching", 32.0, clients=4, duration=60)
    w = window_tokens(r)
    assert w.shape == (6,) and np.allclose(w, 32.0, rtol=0.1)  # each request starts with half a second without tokens
    mean, lo, hi = throughput(r)
    assert lo <= mean <= hi and abs(mean - 32.0) < 2
    cut = dict(r, requests=[dict(q, status="error") for q in r["requests"]])
    assert throughput(cut)[0] == 0  # failed requests stream nothing that counts


def test_targets_need_the_ci_clear_of_the_goal():
    single, batching = run("kvmem-single", 10.0), run("kvmem-batching", 40.0)
    ratio = throughput_ratio(batching, single)
    assert 3.7 < ratio[0] < 4.3 and ratio[1] > 3
    lines = sweep_targets([single, batching, run("transformers", 50.0)])
    assert "kvmem, batch 1 = **" in lines[0] and "goal >= 3x: met" in lines[0]
    assert "goal >= 1x: not met" in lines[1]  # 40 against 50 tokens/s
    assert "no transformers serve" in sweep_targets([single, batching])[1]


def test_segments_run_in_rounds_are_joined_windowed_and_paired():
    """The memory phase's runs: segments joined one after another, two windows a segment, nothing counted past a
    segment's end, and ratios that resample rounds together, so a machine that drifts between rounds moves both."""
    from kvmem_bench.batching.runner import joined_segments

    speeds = [10.0, 20.0, 10.0]  # the machine's speed in each round: the same 2x in every round
    full = joined_segments([run("kvmem-batching", 8.0 * v, duration=60) for v in speeds], 60)
    small = joined_segments([run("kvmem-batching", 16.0 * v, duration=60) for v in speeds], 60)
    assert full["duration_s"] == 180 and full["segments"] == 3
    assert {r["segment"] for r in full["requests"]} == {0, 1, 2} and max(m[0] for m in full["metrics"]) <= 180
    w = window_tokens(full)
    assert w.shape == (6,) and w[2] > 1.6 * w[0]  # round 2 ran twice as fast
    ratio = throughput_ratio(small, full)
    assert 1.8 < ratio[1] <= ratio[0] <= ratio[2] < 2.0  # paired by round: the drift cancels (2x, less the synthetic gaps)
    unpaired = throughput_ratio(small, dict(full, segment_s=None, segments=None))
    assert unpaired[2] - unpaired[1] > 3 * (ratio[2] - ratio[1])
    late = dict(full, requests=[dict(r, chunk_s=[t + 100 for t in r["chunk_s"]]) for r in full["requests"]])
    assert window_tokens(late).sum() < 0.5 * w.sum()  # chunks past their segment's end (cut requests) count nowhere


def test_memory_targets_compare_rows_and_tokens_with_the_full_cache():
    full = run("kvmem-batching", 10.0, clients=16) | dict(phase="memory", config="full", metrics=[[1.0, 1, 1e8, 0]])
    small = run("kvmem-batching", 45.0, clients=16) | dict(phase="memory", config="kvzip@0.25", metrics=[[1.0, 5, 1e8, 0]])
    line = memory_targets([full, small])[0]
    assert "5.0x the sequences at once" in line and "goal >= 4x: met" in line and "goal >= 3x: met" in line
    assert summary(small)["rows_mean"] == 5


def test_suite_scores_are_read_from_the_committed_results(tmp_path):
    (tmp_path / "longctx").mkdir()
    (tmp_path / "quant").mkdir()
    (tmp_path / "longctx" / "results.json").write_text(json.dumps([
        dict(model="m", length=4096, setting="agnostic", task="mean", method="kvzip", keep_ratio=0.25, score=0.88,
             lo=0.81, hi=0.93, n=90)]))
    (tmp_path / "quant" / "results.json").write_text(json.dumps({"tasks": [
        dict(model="m", length=4096, cell="kvzip@0.25 + kivi-4", score=[0.9, 0.8, 1.0], full_score=0.97, n=30),
        dict(model="m", length=4096, cell="kvzip@0.5 + kivi-4", score=[0.5, 0.4, 0.6], full_score=0.97, n=30)]}))
    (tmp_path / "batching" / "scores").mkdir(parents=True)  # the batching benchmark's own run comes first
    (tmp_path / "batching" / "scores" / "results.json").write_text(json.dumps({"tasks": [
        dict(model="m", length=4096, cell="kvzip@0.5 + kivi-4", score=[0.93, 0.87, 0.97], full_score=0.95, n=60,
             vs_full=[-0.02, -0.05, 0.0])]}))
    assert suite_score({"method": "kvzip", "keep_ratio": 0.25}, "m", results=tmp_path) == "0.88 [0.81, 0.93] (n=90)"
    assert suite_score({"method": "kvzip", "keep_ratio": 0.25, "quant": "kivi-4"}, "m", results=tmp_path).startswith(
        "0.90 [0.80, 1.00] vs full 0.97")
    assert suite_score({"method": "kvzip", "keep_ratio": 0.5, "quant": "kivi-4"}, "m", results=tmp_path) == (
        "0.93 [0.87, 0.97] vs full 0.95 (n=60, paired difference -0.02 [-0.05, 0.00], results/batching/scores)")
    assert suite_score({"quant": "kivi-2"}, "m", results=tmp_path) == "not measured at this length"
    # the memory-bound verdict: rows, tokens/s and the score against the full cache's (0.93 / 0.95 = 98 %)
    full = run("kvmem-batching", 10.0, clients=16) | dict(phase="memory", config="full", metrics=[[1.0, 1, 1e8, 0]])
    both = run("kvmem-batching", 45.0, clients=16) | dict(phase="memory", config="kvzip@0.5+kivi-4",
                                                          options={"method": "kvzip", "keep_ratio": 0.5, "quant": "kivi-4"},
                                                          metrics=[[1.0, 9, 1e8, 0]])
    line = memory_targets([full, both], "m", results=tmp_path)[0]
    # a paired difference whose CI reaches below -5 % of the full cache's score (-0.05 < -0.0475) shows nothing
    assert "9.0x the sequences" in line and "score 98% of the full cache's" in line and "goal >= 95 %: not shown" in line
    assert score_verdict(dict(full=0.95, score=[0.93, 0.87, 0.97], diff=[-0.02, -0.04, 0.0])) == "met"
    assert score_verdict(dict(full=0.97, score=[0.80, 0.67, 0.93], diff=[-0.17, -0.30, -0.07])) == "not met"
    assert score_verdict(dict(full=0.92, score=[0.88, 0.81, 0.93], diff=None)) == (
        "met by the point estimate (no paired difference in that suite)")


@pytest.mark.parametrize("with_steps", [False, True])
def test_the_report_has_its_sections(tmp_path, with_steps):
    data = {"config": dict(model="smollm2-135m", threads=2, max_tokens=64, cpus=2, commit="abc", dirty=False),
            "runs": [run("kvmem-single", 10.0), run("kvmem-batching", 35.0)]}
    if with_steps:
        data["steps"] = dict(length=1024, steps=8, padding=[
            dict(rows=16, lengths="ragged", kind=k, round=0, ms=ms, tokens=[1000, 500]) for k, ms in
            (("packed", 170.0), ("padded", 150.0))], quant=[
            dict(rows=16, scheme=s, round=0, ms=ms, kv_bytes=b) for s, ms, b in
            (("full", 200.0, 7e8), ("kivi-4", 500.0, 2e8))])
    (tmp_path / "batching.json").write_text(json.dumps(data))
    text = write_report(tmp_path).read_text()
    assert "## Throughput against concurrency" in text and "goal >= 3x" in text
    assert (tmp_path / "throughput.png").exists()
    assert ("| 16 | ragged: 500, 1000 | 170.0 | 150.0 | 0.88x |" in text) == with_steps
    assert ("| kivi-4 | 500.0 | 2.50x |" in text) == with_steps

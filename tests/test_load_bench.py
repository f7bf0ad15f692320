"""The load test's report writer on a synthetic load.json whose numbers are worked out by hand (no server here)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmem_bench.serve.report import phase_summary, restart_refill, rss_growth, soak_intervals, write_report
from kvmem_bench.stats import bootstrap_median

COMMAND = "python -m kvmem_bench.serve.runner --out results/serve --clients 2 --duration 20 --soak 40"


def _req(t0: float, t1: float, ttft: float | None, cached: int | None = 0, status: str = "ok", warmup: bool = False,
         question: str = "q", text: str = "an answer", error: str | None = None) -> dict:
    ok = status == "ok"
    return dict(seq=0, client=-1 if warmup else 0, warmup=warmup, question=question, t_start_s=t0, t_end_s=t1, status=status,
                error=error, ttft_s=ttft if ok else None, latency_s=t1 - t0, prompt_tokens=1560 if ok else None,
                completion_tokens=16 if ok else None, cached_tokens=cached if ok else None, finish_reason="length" if ok else None,
                text=text if ok else "", retry_after_s=1.0 if status == "429" else None)


def _phase(name: str, store: str | None, requests: list[dict], rss: list[list[float]], t_steady: float = 1.0, **extra) -> dict:
    return dict(name=name, store=store, started="2025-01-01T00:00:00+00:00", finished="2025-01-01T00:01:00+00:00",
                duration_s=4.0, server=dict(command=f"kvmem serve --store {store}", ready_s=3.0, pid=1, port=1),
                metrics_start={"status": 200, "values": {"kvmem_requests_total": 0.0, "kvmem_up": 1.0}},
                metrics_end={"status": 200, "values": {"kvmem_requests_total": 7.0, "kvmem_up": 1.0}},
                t_steady_s=t_steady, t_stop_s=6.0, requests=requests, rss=rss, **extra)


def _load_json() -> dict:
    mib = 1024  # KiB
    on = [_req(0.0, 1.0, 2.0 / 3, cached=0, warmup=True, question="warm")]
    # steady state from 1.0 s: TTFT 0.1..0.4 (p50 0.25, p95 0.385), latency - TTFT = 0.4 s over 15 tokens = 26.7 ms
    on += [_req(1.0 + i, 1.5 + i + 0.1 * i, 0.1 * (i + 1), cached=1500, question=f"q{i}", text=f"a{i}") for i in range(4)]
    on[-1]["t_end_s"] = 5.0  # the last ends at 5.0: 4 ok in 4.0 s = 1.00 req/s
    on[-1]["latency_s"] = 0.8
    on += [_req(2.0, 2.1, None, status="429", error="HTTP 429: queue full"),
           _req(3.0, 3.2, None, status="error", error="HTTP 500: boom")]
    # RSS: a 200 MiB peak during the warm-up, then 100,100,110,110,120,120,130,130: growth 130 - 100 = 30 MiB
    rss_on = [[0.5, 200 * mib]] + [[1.0 + 0.5 * i, v * mib] for i, v in enumerate([100, 100, 110, 110, 120, 120, 130, 130])]
    off = [_req(0.0, 2.0, 1.5, cached=0, warmup=True, question="warm")]
    off += [_req(1.0 + i, 2.0 + i + 0.6, 1.0 + 0.2 * i, cached=0, question=f"q{i}", text="a0" if i == 0 else "different")
            for i in range(4)]  # TTFT p50 1.3: off / on = 1.3 / 0.25 = 5.2; answers: the warm-up and q0 equal, 3 differ
    rss_off = [[1.0 + 0.5 * i, 90 * mib] for i in range(8)]
    soak = [_req(0.0, 1.0, 0.9, cached=0, warmup=True, question="warm"),
            _req(2.0, 3.0, 0.2, cached=1500), _req(2.5, 3.5, 0.3, cached=1500),  # before (down at 10)
            _req(11.0, 12.0, 1.5, cached=0), _req(13.0, 14.5, 1.7, cached=0),  # during the outage
            _req(19.0, 21.0, 1.8, cached=0),  # across the restart at 20, during too: p50 1.7 = 6.8x of 0.25
            _req(21.0, 22.0, 1.6, cached=0),  # after: ending after the restart, two refill, then hits
            _req(22.5, 23.0, 0.2, cached=1500), _req(23.5, 24.0, 0.2, cached=1500)]
    rss_soak = [[1.0 + i, 300 * mib] for i in range(20)]
    return dict(command=COMMAND, commit="abc1234", uncommitted_changes=False, started="2025-01-01T00:00:00+00:00",
                finished="2025-01-01T00:05:00+00:00", host=dict(cpus=2, platform="linux", python="3.11"),
                config=dict(model="smollm2-135m", clients=2, duration_s=4.0, soak_s=30.0, redis_down_s=10.0, redis_down_at_s=10.0,
                            max_tokens=16, temperature=0, threads=1, workers=1, queue=16, timeout_s=120,
                            kvmem_options={"use_store": True}, system_prompt_tokens=1536, system_prompt_documents=6,
                            questions=100, rss_every_s=0.5, retry_after_cap_s=5.0, phases=["store_on", "store_off", "soak"]),
                system_prompt="...",
                phases=dict(store_on=_phase("store_on", "memory", on, rss_on),
                            store_off=_phase("store_off", None, off, rss_off),
                            soak=_phase("soak", "redis://127.0.0.1:1/0", soak, rss_soak, redis_down_s=10.0, redis_up_s=20.0)))


@pytest.fixture()
def results(tmp_path: Path) -> Path:
    (tmp_path / "load.json").write_text(json.dumps(_load_json()))
    return tmp_path


def test_phase_numbers_match_the_hand_computed_ones():
    s = phase_summary(_load_json()["phases"]["store_on"])
    assert (s["requests"], s["ok"], s["errors"], s["rate_limited"], s["all_errors"]) == (6, 4, 1, 1, 1)
    assert s["window_s"] == pytest.approx(4.0) and s["requests_per_s"] == pytest.approx(1.0)
    p50, lo, hi = s["ttft_p50"]
    assert p50 == pytest.approx(0.25) and 0.1 <= lo <= p50 <= hi <= 0.4
    assert s["ttft_p95"] == pytest.approx(0.385)
    assert s["decode_ms_p50"] == pytest.approx(400 / 15)
    assert s["cached_mean"] == pytest.approx(1500) and s["hits"] == 4 and s["hit_fraction"] == 1.0
    assert len(s["warmup"]) == 1 and s["warmup"][0]["cached_tokens"] == 0  # the warm-up is not in the steady state
    assert s["rss"]["peak_mib"] == pytest.approx(200) and s["rss"]["growth_mib"] == pytest.approx(30)
    assert (s["rss"]["first_mib"], s["rss"]["last_mib"]) == (pytest.approx(100), pytest.approx(130))


def test_soak_intervals_and_the_refill_after_the_restart():
    soak = _load_json()["phases"]["soak"]
    parts = soak_intervals(soak)
    assert {k: len(v) for k, v in parts.items()} == {"before": 2, "during": 3, "after": 3}
    r = restart_refill(soak["requests"], soak["redis_up_s"])
    assert r["requests"] == 4 and r["first_cached"] == 0 and r["misses_before_hit"] == 2
    assert r["first_hit_after_s"] == pytest.approx(3.0)
    assert (r["later"], r["later_hits"]) == (1, 1)


def test_the_report_has_the_tables_the_command_and_the_plots(results: Path):
    report = write_report(results).read_text()
    assert f"Reproduce: `{COMMAND}`" in report
    assert "| store on | memory | 4 / 6 | 1.00 | 0.250 [" in report
    assert "| 0.385 | " in report and "| 26.7 |" in report and "| 1500 / 1560 | 4 / 4 | 1 (NOT met) | 1 | 200 | 30.0 (100 → 130) |" in report
    assert "| store off | (none) | 4 / 4 | " in report and "| 0 / 1560 | 0 / 4 | 0 (met) | 0 | 90 | 0.0 (90 → 90) |" in report
    assert "store off / store on: 5.20 [" in report
    assert "same answer (greedy) with and without the store: 2 of 5" in report  # the warm-ups too
    assert "| store on | ok | 0.667 | 1.000 | 0 / 1560 |" in report  # the warm-up row
    assert "| during | 3 / 3 | 0 | 0 | 1.700 [" in report and "p50 1.700 s vs 0.250 s before (6.8×): met" in report
    assert "3 of 3 overlapping the outage ok, 0 errors: met" in report
    assert ("of the 4 requests that ended after it, the first loaded 0 tokens; 2 missed before the first hit (which ended "
            "3.0 s after the restart), then 1 of 1 later requests hit: met") in report
    assert "| store on | error | 1 | `HTTP 500: boom` |" in report and "| store on | 429 | 1 | `HTTP 429: queue full` |" in report
    assert "`HTTP 500: boom`" in report and "`kvmem_requests_total` | 0 | 7 |" in report and "kvmem_up" not in report
    for plot in ("ttft.png", "rss.png", "soak.png"):
        assert (results / plot).stat().st_size > 1000 and f"({plot})" in report


def test_a_report_of_one_phase_only(results: Path):
    data = json.loads((results / "load.json").read_text())
    data["phases"] = {"store_on": data["phases"]["store_on"]}
    (results / "load.json").write_text(json.dumps(data))
    report = write_report(results).read_text()
    assert "| store on | memory |" in report and "Store on vs off" not in report and "Soak" not in report
    assert not (results / "soak.png").exists()


def test_bootstrap_median_of_equal_values_has_no_width():
    assert bootstrap_median([0.5] * 9) == (0.5, 0.5, 0.5)
    assert all(math.isnan(x) for x in bootstrap_median([]))
    assert rss_growth([])["samples"] == 0

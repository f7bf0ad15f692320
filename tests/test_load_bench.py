"""The load test's report writer on a synthetic load.json whose numbers are worked out by hand (no kvmem server here;
the cluster soak's chunk map reads a real Redis Cluster, `redis_cluster` in conftest)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvmem.errors import KVMemError

from kvmem_bench.serve.report import (describing_config, keys_landed, outage_windows, phase_summary, replica_ratio,
                                      restart_refill, run_phases, rss_growth, soak_intervals, wrong_answers, write_report)
from kvmem_bench.serve.runner import chunk_starts, keep_previous, node_to_kill
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


# ---------------------------------------------------------------- the Redis Cluster phases


def _cluster_soak() -> dict:
    """A cluster soak: node down from 10 to 20 s; reference answers to q0 and q1; one wrong answer during the outage
    (partial load), one unchecked question (no reference), an error after the restart."""
    mib = 1024
    reqs = [_req(0.0, 1.0, 0.9, cached=0, warmup=True, question="q0", text="A0"),
            _req(2.0, 3.0, 0.2, cached=1500, question="q1", text="A1"),
            _req(3.0, 4.0, 0.2, cached=1400, question="q0", text="A0"),  # before; the most loaded before: 1500
            _req(11.0, 12.0, 1.5, cached=512, question="q1", text="A1"),
            _req(12.0, 14.0, 1.7, cached=0, question="q0", text="not A0"),  # during: the wrong output
            _req(19.0, 21.0, 1.8, cached=512, question="q2", text="no reference"),  # across the restart: during
            _req(21.0, 22.0, 1.6, cached=1024, question="q1", text="A1"),
            _req(22.5, 23.0, 0.2, cached=1500, question="q0", text="A0"),
            _req(23.0, 23.5, None, status="error", error="HTTP 500: boom", question="q1")]
    rss = [[0.5, 500 * mib]] + [[1.0 + i, (300 + (i >= 10) * 20 + (i >= 20) * 5) * mib] for i in range(24)]
    ref = [dict(question=q, status="ok", text=t) for q, t in (("q0", "A0"), ("q1", "A1"))]
    return _phase("cluster_soak", "redis+cluster://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", reqs, rss, redis_down_s=10.0,
                  redis_up_s=20.0, node=1, node_port=2, keys_per_node_at_kill=[2, 4, 1], keys_per_node_at_end=[2, 4, 1],
                  chunk_starts_at_kill=[[0, 768], [256, 512, 1024, 1280], [1536]], why_this_node="holds it",
                  reference=dict(server={}, requests=ref + [dict(question="q9", status="error", text="")]),
                  config=dict(clients=3, threads=1, workers=1))


def _cluster_replicas() -> dict:
    def pair(k: int, before: list[int], after: list[int], ok: bool = True) -> dict:
        a = _req(0.0, 8.0, 7.0, cached=0)
        b = _req(8.0, 9.0, 1.0, cached=1490) if ok else _req(8.0, 9.0, None, status="error", error="boom")
        return dict(system_prompt=k, a=a, b=b, store=dict(before=before, after_a=after))

    return dict(name="cluster_replicas", store="memory,redis+cluster://(local, 3 nodes)", pairs=[
        pair(0, [0, 0, 0], [2, 3, 1]), pair(1, [2, 3, 1], [2, 6, 4]), pair(2, [2, 6, 4], [2, 6, 4], ok=False)])


def test_wrong_outputs_are_answers_that_differ_from_the_reference():
    soak = _cluster_soak()
    wrong, checked = wrong_answers(soak)
    assert [r["text"] for r in wrong] == ["not A0"]
    assert checked == 7  # ok requests with a reference: the warm-up too; q2 has none, the error is not ok


def test_outage_windows_count_wrong_outputs_loads_and_rss_per_window():
    w = outage_windows(_cluster_soak())
    assert {k: (x["requests"], x["ok"], x["errors"]) for k, x in w.items()} == {
        "before": (2, 2, 0), "during": (3, 3, 0), "after": (3, 2, 1)}
    assert {k: (x["wrong"], x["checked"]) for k, x in w.items()} == {"before": (0, 2), "during": (1, 2), "after": (0, 2)}
    assert {k: x["full_loads"] for k, x in w.items()} == {"before": 1, "during": 0, "after": 1}
    assert w["during"]["cached_mean"] == pytest.approx(1024 / 3) and w["during"]["hits"] == 2
    assert {k: x["rss_peak_mib"] for k, x in w.items()} == {"before": 300, "during": 320, "after": 325}


def test_keys_landed_per_node_and_the_cluster_replicas_ratio():
    rep = _cluster_replicas()
    assert [keys_landed(p) for p in rep["pairs"]] == [[2, 3, 1], [0, 3, 3], [0, 0, 0]]
    g, lo, hi, n = replica_ratio(rep)
    assert n == 2 and g == pytest.approx(7.0) and lo == pytest.approx(7.0) and hi == pytest.approx(7.0)


def test_the_report_has_the_cluster_sections(results: Path):
    data = json.loads((results / "load.json").read_text())
    data["phases"] |= dict(cluster_soak=_cluster_soak(), cluster_replicas=_cluster_replicas())
    (results / "load.json").write_text(json.dumps(data))
    report = write_report(results).read_text()
    assert "## Soak on a Redis Cluster: a node killed and restarted" in report
    assert "node 0: [0, 768]; node 1: [256, 512, 1024, 1280]; node 2: [1536] (keys per node 2 / 4 / 1). Node 1 " in report
    assert "| node down | 3 / 3 | 0 | 0 | 1 / 2 | 1.700 [" in report and "| after | 2 / 3 | 1 | 0 | 0 / 2 |" in report
    assert "- no wrong output: 1 of 7 answers (warm-up included) differ from the reference: NOT met" in report
    assert "| 12.0 | 0 | q0 | not A0 | A0 |" in report  # the wrong output, beside its reference
    assert "**1 wrong outputs** of 7 answers" in report  # the headline
    assert "## Two replicas on a Redis Cluster" in report and "| 2 / 3 / 1 | 3 |" in report and "| 0 / 3 / 3 | 2 |" in report
    assert "- where the chunks landed: 1 knowledge base(s) on 3 node(s), 1 knowledge base(s) on 2 node(s), 1 knowledge base(s) on 0 node(s)" in report
    assert "**two replicas on a three-node Redis Cluster**" in report and "7.0× [7.0, 7.0] over 2" in report
    assert (results / "cluster_soak.png").stat().st_size > 1000 and "(cluster_soak.png)" in report
    # a load phase in the steady-state table, with its own clients (not the store on / off run's)
    assert "| soak (Redis Cluster, a node restarted) (3 clients, 1 worker(s) x 1 thread(s)) | redis+cluster://" in report


def test_a_later_run_keeps_the_earlier_phases_with_their_own_config():
    old = _load_json()
    new = dict(command="later", commit="def5678", started="2025-01-02", config={**old["config"], "clients": 1,
               "phases": ["cluster_soak"]}, phases={}, runs=[dict(command="later", phases=["cluster_soak"])])
    keep_previous(new, old)
    assert set(new["phases"]) == {"store_on", "store_off", "soak"}
    assert new["phases"]["store_on"]["config"]["clients"] == 2  # the run that made it, not the later one
    assert [r["command"] for r in new["runs"]] == [COMMAND, "later"]
    new["phases"]["cluster_soak"] = {"config": new["config"]}
    assert describing_config(new)["clients"] == 2
    new["runs"][0]["phases"] = ["store_on", "store_off", "soak"]
    new["runs"] += [dict(command="soak again", phases=["soak"]), dict(command="last", phases=["cluster_soak", "gone"])]
    assert [(r["command"], made) for r, made in run_phases(new)] == [
        (COMMAND, ["store_on", "store_off"]), ("soak again", ["soak"]), ("last", ["cluster_soak"])]  # "later" made none left
    other = dict(new, config={**new["config"], "max_tokens": 64}, phases={}, runs=[])
    keep_previous(other, old)  # another workload: nothing kept
    assert other["phases"] == {}


def test_the_node_killed_is_the_one_with_the_earliest_chunk_after_the_first_ones_node():
    assert node_to_kill([[0, 768], [256, 512], [1536]])[0] == 1  # node 0 holds chunk 0; node 1 the next earliest
    assert node_to_kill([[512], [], [0, 256]])[0] == 0
    node, why = node_to_kill([[], [0, 256, 512], []])  # everything on one node: that one, said so
    assert node == 1 and "every chunk" in why
    with pytest.raises(KVMemError, match="no chunk"):
        node_to_kill([[], [], []])


def test_chunk_starts_reads_the_frames_on_each_node(redis_cluster):
    """Frames with known first tokens, written through the cluster tier: each is found on the node that owns its key."""
    import redis
    import torch

    from kvmem.store.chunk import pack
    from kvmem.store.tiers import parse_stack

    def flush() -> None:
        for port in redis_cluster.ports:
            redis.Redis(host="127.0.0.1", port=port).flushall()

    flush()
    (tier,) = parse_stack(redis_cluster.url)
    expected = [[] for _ in redis_cluster.ports]
    nodes = [f"127.0.0.1:{p}" for p in redis_cluster.ports]
    for i in range(12):
        key = f"{i:016x}"
        assert tier.put(key, pack({"k": torch.zeros(2)}, {"start": 256 * i, "tokens": 256})) == "ok"
        expected[nodes.index(tier.client().get_node_from_key(f"kvmem:{key}").name)].append(256 * i)
    assert chunk_starts(redis_cluster) == expected and sum(map(len, expected)) == 12
    assert sum(bool(e) for e in expected) >= 2  # 12 keys spread over more than one node
    flush()  # the cluster is shared by the session's tests

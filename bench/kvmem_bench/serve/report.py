"""The load test's report (OUT/report.md, plots) from OUT/load.json (`kvmem_bench/serve/runner.py` writes it and says what is
measured).

Per phase, the steady state (every request after the warm-up): requests/s (ok requests over the time from the
steady state's start to its last request's end), TTFT p50 with a bootstrap 95% CI and p95, latency, decode time
per token, mean cached tokens and the fraction of requests that loaded any, errors (goal 0) and 429s apart, peak
RSS and its growth (median of the last quarter of the steady state's samples minus that of the first quarter).
The warm-up request is its own table. Store on vs off: the ratio of the TTFT medians with a bootstrap CI (the
two phases resampled independently) and whether the same question got the same answer. The soak: the same
numbers before, during and after the Redis outage, and what the restart did (refill, then hits). The replicas, on
one Redis and on a Redis Cluster (with where each knowledge base's keys landed). The cluster soak: the same windows
around a node's outage, and wrong outputs: answers that differ from the reference answer to the same question (a
server without a store, greedy decoding).

Percentiles are numpy's (linear interpolation)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from kvmem_bench.serve import NOT_LOAD, PHASE_LABELS, reference_texts, wrong_answers
from kvmem_bench.serve.plots import plots
from kvmem_bench.stats import bootstrap_median, median_ratio, percentile

METRIC_ROWS = 40  # per phase, of the metrics that changed


def rss_growth(samples: list[list[float]], t_from: float = 0.0) -> dict:
    """Peak RSS (all samples) and, over the samples from `t_from` on, the median of the first and of the last
    quarter and their difference; MiB."""
    peak = max((kib for _, kib in samples), default=math.nan) / 1024
    xs = [kib for t, kib in samples if t >= t_from]
    if not xs:
        return dict(peak_mib=peak, first_mib=math.nan, last_mib=math.nan, growth_mib=math.nan, samples=0)
    q = max(1, len(xs) // 4)
    first, last = float(np.median(xs[:q])) / 1024, float(np.median(xs[-q:])) / 1024
    return dict(peak_mib=peak, first_mib=first, last_mib=last, growth_mib=last - first, samples=len(xs))


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if len(xs) else math.nan


def request_stats(reqs: list[dict]) -> dict:
    """Counts and latency statistics of a set of request records (any phase, any interval)."""
    ok = [r for r in reqs if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok]
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    decode = [(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) * 1000 for r in ok
              if r["completion_tokens"] and r["completion_tokens"] > 1]
    hits = sum(c > 0 for c in cached)
    return dict(requests=len(reqs), ok=len(ok), errors=sum(r["status"] == "error" for r in reqs),
                rate_limited=sum(r["status"] == "429" for r in reqs), ttft_p50=bootstrap_median(ttft),
                ttft_p95=percentile(ttft, 95), latency_p50=percentile([r["latency_s"] for r in ok], 50),
                decode_ms_p50=percentile(decode, 50), completion_mean=_mean([r["completion_tokens"] for r in ok]),
                cached_mean=_mean(cached), prompt_mean=_mean([r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]),
                hits=hits, hit_fraction=hits / len(cached) if cached else math.nan)


def phase_summary(phase: dict) -> dict:
    """The steady state's numbers (`request_stats` plus requests/s and RSS), the warm-up and the errors."""
    reqs = phase["requests"]
    steady = [r for r in reqs if not r["warmup"]]
    stats = request_stats(steady)
    window = max((r["t_end_s"] for r in steady), default=phase["t_steady_s"]) - phase["t_steady_s"]
    stats["window_s"] = window
    stats["requests_per_s"] = stats["ok"] / window if window > 0 else math.nan
    stats["rss"] = rss_growth(phase["rss"], phase["t_steady_s"])
    stats["warmup"] = [r for r in reqs if r["warmup"]]
    stats["all_errors"] = sum(r["status"] == "error" for r in reqs)  # the warm-up's too: the goal is none at all
    stats["all_429"] = sum(r["status"] == "429" for r in reqs)
    stats["error_messages"] = Counter((r["status"], r["error"]) for r in reqs if r["status"] != "ok")
    return stats


def soak_intervals(phase: dict) -> dict[str, list[dict]]:
    """The soak's steady-state requests against the outage [down, up]: ended before it, overlapping it (queued,
    computed or streamed while Redis was down, or across a boundary), started after the restart."""
    down, up = phase["redis_down_s"], phase["redis_up_s"]
    out = {"before": [], "during": [], "after": []}
    for r in phase["requests"]:
        if not r["warmup"]:
            out["before" if r["t_end_s"] <= down else "after" if r["t_start_s"] >= up else "during"].append(r)
    return out


def restart_refill(requests: list[dict], up: float) -> dict:
    """What the requests that ended after the restart did, in the order they ended (the order a single worker
    served them): the misses before the first hit (they refill the emptied Redis), when that hit ended, and how
    many of the requests ending after it hit too."""
    ok = sorted((r for r in requests if not r["warmup"] and r["status"] == "ok" and r["t_end_s"] > up
                 and r["cached_tokens"] is not None), key=lambda r: r["t_end_s"])
    first = ok[0]["cached_tokens"] if ok else None
    hit = next((i for i, r in enumerate(ok) if r["cached_tokens"] > 0), None)
    if hit is None:
        return dict(requests=len(ok), misses_before_hit=len(ok), first_hit_after_s=None, later=0, later_hits=0,
                    first_cached=first)
    later = ok[hit + 1:]
    return dict(requests=len(ok), misses_before_hit=hit, first_hit_after_s=ok[hit]["t_end_s"] - up, later=len(later),
                later_hits=sum(r["cached_tokens"] > 0 for r in later), first_cached=first)


def outage_windows(phase: dict) -> dict[str, dict]:
    """Per window of `soak_intervals` (before, during the outage, after): `request_stats`, the answers compared
    with the reference (`checked`, `wrong`), the requests that loaded as many tokens as the most any request loaded
    before the outage (`full_loads`: the whole stored prefix; on a cluster a request may load part of it), and the
    peak RSS of the samples in the window (before: from the steady state's start; after: to the end)."""
    ref = reference_texts(phase)
    parts = soak_intervals(phase)
    most = max((r["cached_tokens"] or 0 for r in parts["before"] if r["status"] == "ok"), default=None)
    bounds = {"before": (phase["t_steady_s"], phase["redis_down_s"]), "during": (phase["redis_down_s"], phase["redis_up_s"]),
              "after": (phase["redis_up_s"], math.inf)}
    out = {}
    for name, reqs in parts.items():
        st = request_stats(reqs)
        ok = [r for r in reqs if r["status"] == "ok" and r["question"] in ref]
        st["checked"], st["wrong"] = len(ok), sum(r["text"] != ref[r["question"]] for r in ok)
        st["full_loads"] = None if most is None else sum(r["status"] == "ok" and (r["cached_tokens"] or 0) >= most
                                                         for r in reqs)
        lo, hi = bounds[name]
        st["rss_peak_mib"] = max((kib for t, kib in phase["rss"] if lo <= t <= hi), default=math.nan) / 1024
        out[name] = st
    return out


def same_answers(a: dict, b: dict) -> tuple[int, int]:
    """(equal, compared): answers of the two phases' ok requests to the same question."""
    first = {r["question"]: r["text"] for r in a["requests"] if r["status"] == "ok"}
    pairs = [(first[r["question"]], r["text"]) for r in b["requests"] if r["status"] == "ok" and r["question"] in first]
    return sum(x == y for x, y in pairs), len(pairs)


def _f(x: float, digits: int = 3) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(c: tuple[float, float, float], digits: int = 3) -> str:
    return "" if math.isnan(c[0]) else f"{c[0]:.{digits}f} [{c[1]:.{digits}f}, {c[2]:.{digits}f}]"


def _cell(text: object, limit: int = 300) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "/").replace("\n", " ")[:limit]


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _metric_changes(phase: dict) -> list[tuple[str, float, float]]:
    """Samples that changed over the phase, histogram buckets and `_created` timestamps left out."""
    a, b = phase.get("metrics_start", {}).get("values", {}), phase.get("metrics_end", {}).get("values", {})
    skip = lambda k: k.split("{")[0].endswith(("_bucket", "_created"))  # noqa: E731
    return [(k, a.get(k, math.nan), v) for k, v in b.items() if a.get(k) != v and not skip(k)]


def batching_gain(phase: dict) -> tuple[float, float, float]:
    """Decode throughput at batch B over batch 1: (median ratio over the runs, min, max)."""
    r = [(x["batched_tokens"] / x["batched_s"]) / (x["single_tokens"] / x["single_s"]) for x in phase["runs"]]
    return float(np.median(r)), min(r), max(r)


def batching_section(phase: dict) -> list[str]:
    g = batching_gain(phase)
    lines = ["", "## What batch size 1 leaves on the table", "",
             f"The engine decodes one sequence per worker. Here, in one process with {phase['threads']} threads, one "
             f"{phase['context_tokens']}-token prompt is prefilled once, then {phase['batch']} answers of "
             f"{phase['tokens_per_row']} tokens are decoded one after another (batch 1) and together in one batch "
             "(`kvmem.generate.answer_batch`), alternately.", "",
             f"| run | batch 1 tokens/s | batch {phase['batch']} tokens/s | gain | same tokens |", "|---|---|---|---|---|"]
    for i, x in enumerate(phase["runs"]):
        a, b = x["single_tokens"] / x["single_s"], x["batched_tokens"] / x["batched_s"]
        lines.append(f"| {i} | {a:.1f} | {b:.1f} | {b / a:.2f}× | {x['same_tokens']} |")
    lines += ["", f"- batching {phase['batch']} requests' decode steps: {g[0]:.2f}× the tokens/s (runs {g[1]:.2f} to "
                  f"{g[2]:.2f}) on this CPU; on a GPU, where a batch-1 step leaves the device mostly idle, far more"]
    return lines


def keys_landed(pair: dict) -> list[int] | None:
    """Keys replica A added on each cluster node (after A - before A), or None without a cluster."""
    store = pair.get("store")
    if not store or store.get("before") is None or store.get("after_a") is None:
        return None
    return [a - b for a, b in zip(store["after_a"], store["before"])]


def replica_ratio(phase: dict) -> tuple[float, float, float, int] | None:
    """TTFT A / B as the geometric mean of the ok pairs with a bootstrap CI of the mean log, and the pairs."""
    from kvmem_bench.stats import bootstrap_mean

    pairs = [p for p in phase["pairs"] if p["a"]["status"] == p["b"]["status"] == "ok"]
    if not pairs:
        return None
    m, lo, hi = bootstrap_mean([math.log(p["a"]["ttft_s"] / p["b"]["ttft_s"]) for p in pairs])
    return math.exp(m), math.exp(lo), math.exp(hi), len(pairs)


def replica_section(phase: dict) -> list[str]:
    """Two replicas on one Redis (or a Redis Cluster): per knowledge base, TTFT on A (computed, written through)
    and on B (another question, loaded from Redis); the paired ratio A / B (`replica_ratio`). On a cluster, the
    keys A wrote per node."""
    cluster = phase["name"] == "cluster_replicas"
    pairs = [p for p in phase["pairs"] if p["a"]["status"] == p["b"]["status"] == "ok"]
    where = "a three-node Redis Cluster (`LocalRedisCluster`, no replicas)" if cluster else "one redis-server"
    tier = "redis+cluster://..." if cluster else "redis://..."
    lines = ["", f"## Two replicas on {'a Redis Cluster' if cluster else 'one Redis'}", "",
             f"Two `kvmem serve --store memory,{tier}` processes on {where}. Per knowledge base (one "
             "neither has seen): a request to replica A, which computes the system prompt and writes its chunks through "
             "to Redis, then another question on the same knowledge base to replica B, which loads them from Redis. "
             "One request at a time." + (" Chunks per node: the keys A added on each node (DBSIZE after A - before A; a key "
                                         "per chunk of the prompt, the last one partial)."
                                         if cluster else ""), "",
             "| knowledge base | prompt tokens | A: TTFT s (cached) | B: TTFT s (cached from Redis) | A / B |"
             + (" chunks A wrote per node | nodes |" if cluster else ""),
             "|---|---|---|---|---|" + ("---|---|" if cluster else "")]
    for p in phase["pairs"]:
        a, b = p["a"], p["b"]
        ratio = a["ttft_s"] / b["ttft_s"] if a["ttft_s"] and b["ttft_s"] else math.nan
        landed = keys_landed(p)
        extra = (f" {' / '.join(map(str, landed))} | {sum(k > 0 for k in landed)} |" if landed is not None else " | |"
                 ) if cluster else ""
        lines.append(f"| {p['system_prompt']} | {a['prompt_tokens']} | {_f(a['ttft_s'])} ({a['cached_tokens']}) | "
                     f"{_f(b['ttft_s'])} ({b['cached_tokens']}) | {_f(ratio, 1)} |" + extra)
    if pairs:
        g, lo, hi, n = replica_ratio(phase)
        share = sum(p["b"]["cached_tokens"] / p["b"]["prompt_tokens"] for p in pairs) / len(pairs)
        lines += ["", f"- TTFT, replica A (computed) / replica B (reused from A through Redis): {g:.1f}× "
                      f"[{lo:.1f}, {hi:.1f}] (geometric mean of {n} pairs, bootstrap 95% CI); "
                      f"B loaded {share:.1%} of its prompt tokens",
                  f"- errors: {sum(p['a']['status'] != 'ok' or p['b']['status'] != 'ok' for p in phase['pairs'])}"]
        landed = [k for k in map(keys_landed, phase["pairs"]) if k is not None]
        if cluster and landed:
            spread = Counter(sum(k > 0 for k in x) for x in landed)
            totals = [sum(col) for col in zip(*landed)]
            lines.append(f"- where the chunks landed: {', '.join(f'{n} knowledge base(s) on {m} node(s)' for m, n in sorted(spread.items(), reverse=True))}; "
                         f"all pairs together, chunks per node {' / '.join(map(str, totals))}")
    return lines


def cluster_soak_section(phase: dict) -> list[str]:
    """The cluster soak: per window around the node's outage, requests, TTFT, cached tokens, wrong outputs, RSS."""
    cfg = phase.get("config", {})
    down, up = phase["redis_down_s"], phase["redis_up_s"]
    win = outage_windows(phase)
    wrong, checked = wrong_answers(phase)
    warm = [r for r in phase["requests"] if r["warmup"]]
    ref = phase["reference"]["requests"]
    keys = phase.get("keys_per_node_at_kill")
    lines = ["", "## Soak on a Redis Cluster: a node killed and restarted", "",
             f"`--store {phase['store']}` only (three nodes, no replicas, `--cluster-require-full-coverage no`), "
             f"{cfg.get('clients', '?')} clients for {phase['duration_s']:g} s, `--threads {cfg.get('threads', '?')} "
             f"--workers {cfg.get('workers', '?')}`; they ask {len(ref)} questions in turn. Chunks per node at the kill "
             f"(their first tokens): {'; '.join(f'node {i}: {s}' for i, s in enumerate(phase.get('chunk_starts_at_kill') or []))}"
             f" (keys per node {' / '.join(map(str, keys)) if keys else '?'}). Node {phase.get('node')} (port "
             f"{phase.get('node_port')}; it {phase.get('why_this_node', '?')}) was killed at {down:.1f} s and started "
             f"again (empty; it rejoins with its slots) at "
             f"{up:.1f} s ({up - down:.1f} s down); keys per node at the end: "
             f"{' / '.join(map(str, phase.get('keys_per_node_at_end') or [])) or '?'}. "
             f"Reference: before the soak, a server without a store answered each question once (one at a time; "
             f"{sum(r['status'] == 'ok' for r in ref)} of {len(ref)} ok); a wrong output is an answer that differs from "
             "the reference answer to its question (greedy decoding: the same prompt must give the same text). "
             "Windows as in the Redis soak: ended before the kill, overlapping the outage, started after the restart. "
             "Whole prefix: requests that loaded as many tokens as the most any request loaded before the outage.", "",
             "| window | ok / requests | errors | 429s | wrong outputs / compared (goal 0) | TTFT p50 s [95% CI] | TTFT p95 s "
             "| mean cached tokens | hits (any) | whole prefix | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, x in win.items():
        lines.append(f"| {'node down' if k == 'during' else k} | {x['ok']} / {x['requests']} | {x['errors']} | "
                     f"{x['rate_limited']} | {x['wrong']} / {x['checked']} | {_ci(x['ttft_p50'])} | {_f(x['ttft_p95'])} | "
                     f"{_f(x['cached_mean'], 0)} | {x['hits']} / {x['ok']} | {x['full_loads']} / {x['ok']} | "
                     f"{_f(x['rss_peak_mib'], 0)} |")
    rss = rss_growth(phase["rss"], phase["t_steady_s"])
    b, d = win["before"]["ttft_p50"][0], win["during"]["ttft_p50"][0]
    errors = sum(r["status"] == "error" for r in phase["requests"])
    lines += ["", "Checks:", "",
              f"- no wrong output: {len(wrong)} of {checked} answers (warm-up included) differ from the reference: "
              f"{_met(not wrong and checked > 0)}",
              f"- requests succeed while the node is down: {win['during']['ok']} of {win['during']['requests']} overlapping "
              f"the outage ok; errors over the whole soak (warm-up included): {errors}: "
              f"{_met(errors == 0 and win['during']['requests'] > 0)}",
              f"- the dead node's chunks are recomputed: mean cached tokens {_f(win['during']['cached_mean'], 0)} while it "
              f"is down vs {_f(win['before']['cached_mean'], 0)} before; TTFT p50 {_f(d)} s vs {_f(b)} s before",
              f"- after the restart: {win['after']['full_loads']} of {win['after']['ok']} requests loaded the whole prefix "
              f"again (mean cached {_f(win['after']['cached_mean'], 0)})",
              f"- server RSS: peak {_f(rss['peak_mib'], 0)} MiB, growth over the steady state {_f(rss['growth_mib'], 1)} "
              f"MiB ({_f(rss['first_mib'], 0)} → {_f(rss['last_mib'], 0)})"]
    if warm:
        w = warm[0]
        lines.append(f"- warm-up (fills the cluster): TTFT {_f(w['ttft_s'])} s, {w['cached_tokens']} cached of "
                     f"{w['prompt_tokens']}")
    if wrong:
        ref_text = reference_texts(phase)
        lines += ["", "| request | start s | cached | question | answer | reference |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['seq']} | {r['t_start_s']:.1f} | {r['cached_tokens']} | {_cell(r['question'], 80)} | "
                  f"{_cell(r['text'], 120)} | {_cell(ref_text[r['question']], 120)} |" for r in wrong]
    return lines


def headline(data: dict) -> list[str]:
    """The figures the issue asks for, as bullets (the report's Headline and the README's serve block)."""
    phases = data["phases"]
    cfg, out = describing_config(data), []
    sums = {k: phase_summary(v) for k, v in phases.items() if k not in NOT_LOAD}
    if "store_on" in sums and "store_off" in sums:
        on, off = sums["store_on"], sums["store_off"]
        ttft = lambda p: [r["ttft_s"] for r in phases[p]["requests"] if not r["warmup"] and r["status"] == "ok"]  # noqa: E731
        ratio = median_ratio(ttft("store_off"), ttft("store_on"))
        out += [f"- **TTFT under load** ({cfg['clients']} clients, a {cfg['system_prompt_tokens']}-token shared system "
                f"prompt, a different question each): p50 {_ci(on['ttft_p50'], 2)} s with the store, "
                f"{_ci(off['ttft_p50'], 2)} s without: **{_ci(ratio, 1)}×** (p95 {_f(on['ttft_p95'], 2)} vs "
                f"{_f(off['ttft_p95'], 2)} s)",
                f"- **requests/s**: {_f(on['requests_per_s'], 2)} with the store, {_f(off['requests_per_s'], 2)} without "
                f"({cfg['workers']} worker(s) x {cfg['threads']} torch thread(s), batch size 1, {cfg['max_tokens']} tokens per "
                f"answer)"]
    errors = sum(s["all_errors"] for s in sums.values())
    limited = sum(s["all_429"] for s in sums.values())
    total = sum(len(phases[k]["requests"]) for k in sums)
    out.append(f"- **errors**: {errors} of {total} requests (goal 0: {_met(errors == 0)}); 429s: {limited}")
    if sums:
        peak = max(s["rss"]["peak_mib"] for s in sums.values())
        growth = ", ".join(f"{PHASE_LABELS.get(k, k)} {_f(s['rss']['growth_mib'], 0)}" for k, s in sums.items())
        out.append(f"- **server memory**: peak RSS {_f(peak, 0)} MiB; growth over each phase's steady state (MiB, "
                   f"last quarter - first): {growth}")
    for name, where in (("replicas", "one Redis"), ("cluster_replicas", "a three-node Redis Cluster")):
        rep = phases.get(name)
        if rep and (ratio := replica_ratio(rep)):
            b_ttft = percentile([p["b"]["ttft_s"] for p in rep["pairs"] if p["a"]["status"] == p["b"]["status"] == "ok"], 50)
            out.append(f"- **two replicas on {where}**: a knowledge base computed by replica A is loaded by replica B; "
                       f"TTFT A / B {ratio[0]:.1f}× [{ratio[1]:.1f}, {ratio[2]:.1f}] over {ratio[3]} "
                       f"knowledge bases (median B TTFT {_f(b_ttft, 2)} s)")
    if phases.get("batching"):
        g = batching_gain(phases["batching"])
        out.append(f"- **batch size 1** (one sequence per worker) leaves {g[0]:.2f}× decode throughput on this CPU "
                   f"(batch {phases['batching']['batch']} in one forward vs one after another)")
    soak = phases.get("soak")
    if soak and soak.get("redis_down_s") is not None:
        st = {k: request_stats(v) for k, v in soak_intervals(soak).items()}
        out.append(f"- **soak, Redis killed and restarted**: {st['during']['ok']} of {st['during']['requests']} requests "
                   f"overlapping the {soak['redis_up_s'] - soak['redis_down_s']:.0f} s outage succeeded (recomputed: TTFT "
                   f"p50 {_f(st['during']['ttft_p50'][0], 2)} s vs {_f(st['before']['ttft_p50'][0], 2)} s before); after "
                   f"the restart {st['after']['hits']} of {st['after']['ok']} hit the refilled store")
    cluster = phases.get("cluster_soak")
    if cluster and cluster.get("redis_down_s") is not None:
        win, (wrong, checked) = outage_windows(cluster), wrong_answers(cluster)
        errors = sum(r["status"] == "error" for r in cluster["requests"])
        out.append(f"- **soak on a Redis Cluster, a node killed and restarted**: {errors} errors; "
                   f"**{len(wrong)} wrong outputs** of {checked} answers compared with a no-store server's (goal 0: "
                   f"{_met(not wrong and checked > 0)}); {win['during']['ok']} of {win['during']['requests']} requests "
                   f"overlapping the {cluster['redis_up_s'] - cluster['redis_down_s']:.0f} s outage succeeded (mean cached "
                   f"tokens {_f(win['during']['cached_mean'], 0)} vs {_f(win['before']['cached_mean'], 0)} before, TTFT "
                   f"p50 {_f(win['during']['ttft_p50'][0], 2)} vs {_f(win['before']['ttft_p50'][0], 2)} s)")
    return out


def run_phases(data: dict) -> list[tuple[dict, list[str]]]:
    """Each run of load.json's `runs` with the phases in the file that it made (a phase run again later is the later
    run's), oldest first; runs left with none are dropped."""
    claimed, out = set(), []
    for run in reversed(data.get("runs", [dict(data, phases=list(data["phases"]))])):
        made = [p for p in run["phases"] if p in data["phases"] and p not in claimed]
        claimed |= set(made)
        out.append((run, made))
    return [(r, made) for r, made in reversed(out) if made]


def _label(name: str, phase: dict, cfg: dict) -> str:
    """The phase's name in a table, with its clients and workers where its run had other ones than `cfg`."""
    own = phase.get("config", cfg)
    keys = ("clients", "workers", "threads")
    if all(own.get(k) == cfg.get(k) for k in keys):
        return PHASE_LABELS.get(name, name)
    return (f"{PHASE_LABELS.get(name, name)} ({own.get('clients')} clients, {own.get('workers')} worker(s) x "
            f"{own.get('threads')} thread(s))")


def describing_config(data: dict) -> dict:
    """The config of the run that made the load phases (store on / off, then the soaks): a later run of other
    phases only (say the cluster's, with other clients) does not describe them. Each phase keeps its run's config."""
    first = next((data["phases"][k] for k in ("store_on", "store_off", "soak", "cluster_soak") if k in data["phases"]), {})
    return first.get("config", data["config"])  # (load.json files older than per-phase configs: the run's)


README_MARKERS = ("<!-- serve: regenerated from results/serve/report.md by `make bench-serve` -->", "<!-- /serve -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's serve block: the Headline of RESULTS/serve/report.md."""
    path = Path(results) / "serve" / "report.md"
    if not path.exists():
        return None
    report = path.read_text()
    lines = report[report.index("## Headline") + len("## Headline"):].split("\n## ")[0].strip()
    return (f"{README_MARKERS[0]}\n**Serve** (issue 11; `make bench-serve`): `kvmem serve` under concurrent clients on "
            f"loopback. Full report: [results/serve/report.md](results/serve/report.md).\n\n{lines}\n{README_MARKERS[1]}")


def write_report(out: Path) -> Path:
    """OUT/report.md (and its plots) from OUT/load.json; returns the report's path."""
    out = Path(out)
    data = json.loads((out / "load.json").read_text())
    cfg, phases = describing_config(data), {k: v for k, v in data["phases"].items() if k not in NOT_LOAD}
    batching = data["phases"].get("batching")
    summaries = {name: phase_summary(p) for name, p in phases.items()}
    lines = ["# Load test: `kvmem serve` under concurrent clients", "",
             *(f"Reproduce: `{r['command']}`" + (f" (phases {', '.join(made)}; commit {r['commit']})"
                                                 if len(data.get("runs", [])) > 1 else "")
               for r, made in run_phases(data)), "",
             f"{'Last run' if len(data.get('runs', [])) > 1 else 'Run'} {data['started']} to "
             f"{data.get('finished') or '(unfinished)'}, commit {data['commit']}"
             + (" with uncommitted changes" if data.get("uncommitted_changes") else "")
             + f", {data['host']['cpus']} CPUs. Load phases (where their section does not say otherwise): model "
               f"{cfg['model']}, {cfg['clients']} concurrent clients for "
               f"{cfg['duration_s']:g} s per phase (soak {cfg['soak_s']:g} s), `--threads {cfg['threads']} --workers "
               f"{cfg['workers']} --queue {cfg['queue']}`. Each request: the shared system prompt ({cfg['system_prompt_tokens']} "
               f"tokens, {cfg['system_prompt_documents']} abstracts) and a different question, streamed, temperature 0, "
               f"max_tokens {cfg['max_tokens']}, kvmem options `{json.dumps(cfg['kvmem_options'])}`"
               + (f" (with a store also `{json.dumps(cfg['kvmem_store_options'])}`)" if cfg.get("kvmem_store_options") else "")
               + ". Every request is in "
               "`load.json`; what is measured and why: `kvmem_bench/serve/runner.py`.", "",
             "## Headline", "", *headline(data), "",
             "## Steady state per phase", "",
             "After the warm-up request; requests/s = ok requests / (last request's end - steady state's start). TTFT: "
             "until the first content chunk; p50 with its bootstrap 95% CI. Decode: (latency - TTFT) / (completion tokens - 1). "
             "Cached: prompt tokens loaded from the store (`usage.prompt_tokens_details.cached_tokens`); hits: requests that "
             "loaded any. Errors count the warm-up too (goal 0); 429s apart. RSS: the server's process tree; growth = "
             "median of the steady state's last quarter of samples - its first quarter.", "",
             "| phase | `--store` | ok / requests | req/s | TTFT p50 s [95% CI] | TTFT p95 s | latency p50 s | decode ms/token p50 "
             "| mean cached / prompt tokens | hits | errors (goal 0) | 429s | peak RSS MiB | RSS growth MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        rss = s["rss"]
        lines.append(
            f"| {_label(name, phases[name], cfg)} | {phases[name]['store'] or '(none)'} | {s['ok']} / {s['requests']} | "
            f"{_f(s['requests_per_s'], 2)} | {_ci(s['ttft_p50'])} | {_f(s['ttft_p95'])} | {_f(s['latency_p50'])} | "
            f"{_f(s['decode_ms_p50'], 1)} | {_f(s['cached_mean'], 0)} / {_f(s['prompt_mean'], 0)} | {s['hits']} / {s['ok']} | "
            f"{s['all_errors']} ({_met(s['all_errors'] == 0)}) | {s['all_429']} | {_f(rss['peak_mib'], 0)} | "
            f"{_f(rss['growth_mib'], 1)} ({_f(rss['first_mib'], 0)} → {_f(rss['last_mib'], 0)}) |")
    lines += ["", "## The warm-up request (alone, before the clients start)", "",
              "With a store it computes the system prompt and fills the store; without one it is the first cold request.", "",
              "| phase | status | TTFT s | latency s | cached / prompt tokens | server ready after s |", "|---|---|---|---|---|---|"]
    for name, s in summaries.items():
        for r in s["warmup"]:
            status = r["status"] + (f" (`{_cell(r['error'], 200)}`)" if r["error"] else "")
            lines.append(f"| {_label(name, phases[name], cfg)} | {status} | "
                         f"{_f(r['ttft_s'])} | {_f(r['latency_s'])} | {r['cached_tokens']} / {r['prompt_tokens']} | "
                         f"{_f(phases[name]['server'].get('ready_s'), 1)} |")
    if "store_on" in phases and "store_off" in phases:
        on, off = (
            [r["ttft_s"] for r in phases[p]["requests"] if not r["warmup"] and r["status"] == "ok"] for p in ("store_on", "store_off"))
        ratio = median_ratio(off, on)
        eq, n = same_answers(phases["store_off"], phases["store_on"])
        lat = median_ratio([r["latency_s"] for r in phases["store_off"]["requests"] if not r["warmup"] and r["status"] == "ok"],
                           [r["latency_s"] for r in phases["store_on"]["requests"] if not r["warmup"] and r["status"] == "ok"])
        rps_on, rps_off = summaries["store_on"]["requests_per_s"], summaries["store_off"]["requests_per_s"]
        lines += ["", "## Store on vs off", "",
                  f"- TTFT p50, store off / store on: {_ci(ratio, 2)}× (bootstrap 95% CI, the phases resampled independently)",
                  f"- latency p50, store off / store on: {_ci(lat, 2)}×",
                  f"- requests/s: {_f(rps_on, 2)} with the store, {_f(rps_off, 2)} without"
                  + (f" ({rps_on / rps_off:.2f}×)" if rps_off and not math.isnan(rps_off) and rps_off > 0 else ""),
                  f"- same question, same answer (greedy) with and without the store: {eq} of {n}"]
    soak = phases.get("soak")
    if soak and soak.get("redis_down_s") is not None:
        down, up = soak["redis_down_s"], soak["redis_up_s"]
        parts = soak_intervals(soak)
        st = {k: request_stats(v) for k, v in parts.items()}
        refill = restart_refill(soak["requests"], up)
        lines += ["", "## Soak: Redis killed and restarted", "",
                  f"`--store {soak['store']}` only (no memory tier to hide the outage). redis-server killed at {down:.1f} s, "
                  f"started again (empty) at {up:.1f} s ({up - down:.1f} s down), seconds from the soak's start. Requests: "
                  "ended before the kill, overlapping the outage (queued, computed or streamed while Redis was down), "
                  "started after the restart.", "",
                  "| interval | ok / requests | errors | 429s | TTFT p50 s [95% CI] | TTFT p95 s | mean cached tokens | hits |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, x in st.items():
            lines.append(f"| {k} | {x['ok']} / {x['requests']} | {x['errors']} | {x['rate_limited']} | {_ci(x['ttft_p50'])} | "
                         f"{_f(x['ttft_p95'])} | {_f(x['cached_mean'], 0)} | {x['hits']} / {x['ok']} |")
        b, d = st["before"]["ttft_p50"][0], st["during"]["ttft_p50"][0]
        lines += ["", "Checks:", "",
                  f"- requests succeed while Redis is down: {st['during']['ok']} of {st['during']['requests']} overlapping "
                  f"the outage ok, {st['during']['errors']} errors: {_met(st['during']['errors'] == 0 and st['during']['requests'] > 0)}",
                  f"- TTFT rises while it is down (the server recomputes): p50 {_f(d)} s vs {_f(b)} s before"
                  + (f" ({d / b:.1f}×): {_met(d > b)}" if b and not math.isnan(b) and not math.isnan(d) else ": (not measured)"),
                  f"- after the restart the store refills, then hits: of the {refill['requests']} requests that ended after it, "
                  f"the first loaded {refill['first_cached']} tokens; {refill['misses_before_hit']} missed before the first hit"
                  + (": no hit after the restart: NOT met" if refill["first_hit_after_s"] is None else
                     f" (which ended {refill['first_hit_after_s']:.1f} s after the restart), then no later request to "
                     "check (a longer soak shows it)" if not refill["later"] else
                     f" (which ended {refill['first_hit_after_s']:.1f} s after the restart), then {refill['later_hits']} of "
                     f"{refill['later']} later requests hit: {_met(refill['later_hits'] == refill['later'])}")]
    cluster = phases.get("cluster_soak")
    if cluster and cluster.get("redis_down_s") is not None:
        lines += cluster_soak_section(cluster)
    for name in ("replicas", "cluster_replicas"):
        if data["phases"].get(name):
            lines += replica_section(data["phases"][name])
    if batching:
        lines += batching_section(batching)
    bad = [(name, status, msg, n) for name, s in summaries.items() for (status, msg), n in s["error_messages"].most_common()]
    if bad:
        lines += ["", "## Errors and 429s", "", "| phase | status | count | message |", "|---|---|---|---|"]
        lines += [f"| {PHASE_LABELS.get(name, name)} | {status} | {n} | `{_cell(msg)}` |" for name, status, msg, n in bad]
    rows = [(name, k, a, b) for name, p in phases.items() for k, a, b in _metric_changes(p)[:METRIC_ROWS]]
    if rows:
        lines += ["", "## Server metrics that changed (GET /metrics before the warm-up → after the last request)", "",
                  "| phase | metric | start | end |", "|---|---|---|---|"]
        lines += [f"| {PHASE_LABELS.get(n, n)} | `{k}` | {'(absent)' if math.isnan(a) else f'{a:g}'} | {b:g} |"
                  for n, k, a, b in rows]
    lines += [""] + [f"![{p[:-4]}]({p})" for p in plots(data, out)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"

"""The load test of `kvmem serve`: what a server with stored KV gives under concurrent clients, and how it behaves
when its store goes away.

The workload is a chat assistant over a shared knowledge base: every request carries the same long system prompt
(whole abstracts of `data/abstracts.txt`, about 1500 SmolLM2 tokens, built deterministically) and a different short
user question about one of its documents; temperature 0, `max_tokens` 16, `ignore_eos` (every request decodes the
same number of tokens, so the phases do the same work; with a store, `use_store` and `fill_store` too). N clients
(asyncio, the openai client, no retries) loop for M seconds, each sending a streaming chat completion and waiting
for its end before the next. Per request: TTFT (until the first chunk carrying content; it includes the time spent
queued for a worker, as a user sees it), total latency, completion / prompt / cached tokens (the final usage chunk;
cached = prompt tokens loaded from the store), the answer's text, and the status: ok, 429 (counted; the client waits
Retry-After, capped at 5 s, then goes on) or error (with its message). The server process's RSS (VmRSS, summed over
its process tree) is sampled every 0.5 s; /metrics is scraped before and after.

Phases, one server each, one after another (never side by side: on 2 CPU cores they would time each other):

* `store_on`  (`--store memory`): the system prompt's KV is computed once and reused by every later request.
* `store_off` (no `--store`): every request prefills the whole prompt. The same clients, duration and questions.
  TTFT off / on is the headline; answers to the same question should match (reuse is exact with the raw codec).
* `replicas`: two servers (`--store memory,redis://...`) sharing one redis-server. For each of 8 knowledge bases
  neither has seen (other abstracts than the phases above), one request to replica A (computes the prompt and
  writes it through to Redis), then another question on the same knowledge base to replica B, which loads it
  from Redis: TTFT A (cold) against B (reused across replicas), paired, one request at a time.
* `batching` (in this process, no server): what batch size 1 leaves on the table. The shared system prompt is
  prefilled once; then 4 answers of `BATCHING_TOKENS` tokens each are decoded one after another (batch size 1,
  as a worker does) and all 4 in one batch (`kvmem.generate.answer_batch`); tokens/s of both, same threads.
* `soak` (`--store redis://...` only, so no memory tier hides the outage): a local redis-server is killed a third
  of the way in and restarted (empty) `redis_down_s` later. While it is down requests must still succeed (the
  server recomputes; TTFT rises); after the restart the first requests refill it and later ones hit again. RSS
  over the whole soak shows whether the server leaks.
* `cluster_replicas`: `replicas` on a three-node Redis Cluster (`LocalRedisCluster`; `--store memory,redis+cluster://
  ...`): the same pairs, and per knowledge base how many of the keys replica A wrote landed on each node.
* `cluster_soak` (`--store redis+cluster://...` only): `soak` with one node of the cluster killed instead of the
  whole Redis, and started again (empty, it rejoins with its slots) `redis_down_s` later: not the node holding the
  prompt's first chunk (that would make every request a full recompute, as in `soak`) but the one holding the
  earliest chunk after it (`node_to_kill`), so that requests load the chunks before it from the live nodes and
  compute the rest: loaded and computed KV in one prompt. The clients cycle over `SOAK_QUESTIONS` questions, and
  before the soak a server without a store answers each of them once (one at a time): the workload is greedy, so
  an answer that differs from that reference is a wrong output (the goal: none, before, during and after the
  outage).

Each load phase (not `replicas`, `batching`, `cluster_replicas`) starts with one warm-up request alone (the one
that fills the store, or the first cold request), recorded with `warmup: true` and reported apart from the steady
state that follows. Times in the records are seconds from the phase's start (just before the warm-up). Everything
goes to OUT/load.json (config, the command, the commit, every request, the RSS samples, the metrics; each phase
with the config of the run that made it), written after each phase; OUT/report.md and the plots come from
`kvmem_bench.serve.report.write_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

from kvmem.errors import KVMemError
from kvmem_bench.records import git_commit, now, uncommitted_changes
from kvmem_bench.serve.harness import (knowledge_base, load_tokenizer, one_request, question, question_list, scrape_metrics,
                                       serving, tree_rss_kib)

RSS_EVERY_S = 0.5
RETRY_AFTER_CAP_S = 5.0
ERROR_PAUSE_S = 0.5  # after an error, so a dead server is not hammered in a tight loop
PHASES = ("store_on", "store_off", "soak", "replicas", "batching", "cluster_replicas", "cluster_soak")
SOAKS = ("soak", "cluster_soak")  # the phases with an outage: skipped when the soak's duration is 0
REPLICA_PROMPTS = 8  # distinct knowledge bases in the replicas phases
SOAK_QUESTIONS = 12  # the cluster soak's questions, asked in turn (each is answered once without a store first)
BATCH, BATCHING_TOKENS = 4, 48  # the batching phase: rows, and tokens decoded per row
KVMEM_OPTIONS = {"ignore_eos": True}  # every phase; with a store, also:
STORE_OPTIONS = {"use_store": True, "fill_store": True}  # (a server without one refuses them: 400)


async def _sample_rss(pid: int, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        kib = tree_rss_kib(pid)
        if kib is not None:
            samples.append([round(time.perf_counter() - t0, 3), kib])
        try:
            await asyncio.wait_for(stop.wait(), RSS_EVERY_S)
        except asyncio.TimeoutError:
            pass


async def drive(base: str, pid: int, model: str, system: str, questions: list[str], clients: int, duration_s: float,
                max_tokens: int, request_timeout_s: float, options: dict, during: Callable | None = None,
                log=print, ask: Callable[[int], str] | None = None) -> dict:
    """The warm-up request alone, then `clients` loops for `duration_s`; RSS sampled all along. `during(t0,
    t_steady)` (a coroutine function) runs beside the clients (the soak's Redis outage); its result is returned
    under "events". The k-th request asks `ask(k)` (default `question(k, questions)`: a different one each).
    Times are seconds from t0, just before the warm-up."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=request_timeout_s)
    ask = ask or (lambda k: question(k, questions))
    records, samples, stop, seq = [], [], asyncio.Event(), itertools.count()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample_rss(pid, t0, samples, stop))

    async def request(client_id: int, warmup: bool) -> dict:
        k = next(seq)
        start = time.perf_counter() - t0
        rec = await one_request(client, model, system, ask(k), max_tokens, options)
        rec = dict(seq=k, client=client_id, warmup=warmup, question=ask(k), t_start_s=round(start, 4),
                   t_end_s=round(start + rec["latency_s"], 4), **rec)
        records.append(rec)
        return rec

    async def loop(client_id: int, end_at: float) -> None:
        while time.perf_counter() < end_at:
            rec = await request(client_id, False)
            if rec["status"] == "429":
                await asyncio.sleep(min(rec["retry_after_s"] or 1.0, RETRY_AFTER_CAP_S))
            elif rec["status"] == "error":
                await asyncio.sleep(ERROR_PAUSE_S)

    try:
        warm = await request(-1, True)
        log(f"  warm-up: {warm['status']} TTFT {warm['ttft_s'] or float('nan'):.2f} s, cached {warm['cached_tokens']} "
            f"of {warm['prompt_tokens']} prompt tokens" + (f" ({warm['error']})" if warm["error"] else ""))
        t_steady = time.perf_counter() - t0
        end_at = time.perf_counter() + duration_s
        side = asyncio.create_task(during(t0, t_steady)) if during else None
        await asyncio.gather(*(loop(i, end_at) for i in range(clients)))
        events = await side if side else None
    finally:
        stop.set()
        await sampler
        await client.close()
    return dict(t_steady_s=round(t_steady, 4), t_stop_s=round(time.perf_counter() - t0, 4), requests=records,
                rss=samples, events=events)


async def replica_pairs(a_base: str, b_base: str, model: str, systems: list[str], questions: list[str],
                        max_tokens: int, request_timeout_s: float, options: dict, log=print,
                        after_a: Callable[[], dict] | None = None) -> list[dict]:
    """Per system prompt: a request to replica A, then one with another question to replica B (one at a time).
    `after_a()` runs between the two (and once before the first A); what it returns is the pair's "store"."""
    from openai import AsyncOpenAI

    pairs = []
    clients = [AsyncOpenAI(base_url=f"{b}/v1", api_key="x", max_retries=0, timeout=request_timeout_s)
               for b in (a_base, b_base)]
    try:
        before = after_a() if after_a else None
        for k, system in enumerate(systems):
            a = await one_request(clients[0], model, system, questions[2 * k], max_tokens, options)
            store = after_a() if after_a else None
            b = await one_request(clients[1], model, system, questions[2 * k + 1], max_tokens, options)
            pairs.append(dict(system_prompt=k, a=a, b=b) | ({"store": dict(before=before, after_a=store)} if after_a else {}))
            before = after_a() if after_a else None  # B may write too (its question's chunks): not A's
            log(f"  knowledge base {k}: A {a['status']} TTFT {a['ttft_s'] or float('nan'):.2f} s (cached "
                f"{a['cached_tokens']}), B {b['status']} TTFT {b['ttft_s'] or float('nan'):.2f} s (cached {b['cached_tokens']})"
                + (f"; keys per node after A {store}" if after_a else ""))
    finally:
        for c in clients:
            await c.close()
    return pairs


def redis_outage(kill: Callable[[], object], start: Callable[[], object], at_s: float, down_s: float, log=print,
                 what: str = "redis-server", before_kill: Callable[[], dict] | None = None) -> Callable:
    """A `during` for `drive`: `kill()` a redis-server (the soak's, or one node of the cluster soak's) `at_s` after
    the steady state starts, `start()` it again (same port, empty) `down_s` later; returns the two times (seconds
    from the phase's t0, `redis_down_s` and `redis_up_s`: the server that was down) and what `before_kill()`
    returned (it picks the node, and says why)."""

    async def outage(t0: float, t_steady: float) -> dict:
        await asyncio.sleep(max(0.0, t0 + t_steady + at_s - time.perf_counter()))
        picked = await asyncio.to_thread(before_kill) if before_kill else {}
        await asyncio.to_thread(kill)
        down = time.perf_counter() - t0
        log(f"  {what} stopped at {down:.1f} s")
        await asyncio.sleep(down_s)
        await asyncio.to_thread(start)
        up = time.perf_counter() - t0
        log(f"  {what} started again at {up:.1f} s")
        return dict(redis_down_s=round(down, 4), redis_up_s=round(up, 4), **picked)

    return outage


# ---------------------------------------------------------------- the suite


def default_command(out: Path, clients: int, duration_s: float, soak_s: float, redis_down_s: float | None,
                    threads: int, model: str) -> str:
    cmd = ["python", "-m", "kvmem_bench.serve.runner", "--out", str(out), "--model", model, "--clients", str(clients),
           "--duration", f"{duration_s:g}", "--soak", f"{soak_s:g}", "--threads", str(threads)]
    if redis_down_s is not None:
        cmd += ["--redis-down", f"{redis_down_s:g}"]
    return shlex.join(cmd)


def run_load_suite(out: Path, model: str = "smollm2-135m", clients: int = 4, duration_s: float = 120,
                   soak_s: float = 180, redis_down_s: float | None = None, max_tokens: int = 16,
                   system_tokens: int = 1500, threads: int = 1, workers: int = 1, queue: int = 16, timeout: float = 120,
                   health_timeout_s: float = 600, phases: tuple[str, ...] = PHASES, command: str | None = None,
                   log=print) -> Path:
    """Run the phases (store on, store off, soak; each its own `kvmem serve`, one after another), write
    OUT/load.json after each and OUT/report.md at the end; returns the report's path. `soak_s` 0 skips the soak;
    the outage starts a third of the way into it and lasts `redis_down_s` (default min(20 s, a third of it)).
    `command` is what the report says produced it (default: the `python -m kvmem_bench.serve.runner` equivalent)."""
    from kvmem_bench.serve.report import write_report

    out = Path(out)
    if unknown := set(phases) - set(PHASES):
        raise KVMemError(f"unknown load phase(s) {sorted(unknown)}; the phases are {', '.join(PHASES)}")
    if clients < 1 or duration_s <= 0:
        raise KVMemError("the load test needs at least one client and a positive duration")
    if soak_s <= 0:
        phases = tuple(p for p in phases if p not in SOAKS)
    down_s = redis_down_s if redis_down_s is not None else min(20.0, soak_s / 3)
    if set(SOAKS) & set(phases) and not 0 < down_s < soak_s * 2 / 3:
        raise KVMemError(f"the Redis outage ({down_s:g} s) must fit in the soak's last two thirds ({soak_s * 2 / 3:g} s)")
    redis = None
    if "soak" in phases:
        from kvmem.store.tiers import LocalRedis

        redis = LocalRedis()  # fails now, not after the other phases, when redis-server is missing
    if {"cluster_replicas", "cluster_soak"} & set(phases):
        import shutil

        if shutil.which("redis-cli") is None or shutil.which("redis-server") is None:
            raise KVMemError("the cluster phases need redis-server and redis-cli (`make redis` installs Debian's package)")
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(model)
    system, n_system, n_docs = knowledge_base(tokenizer, system_tokens)
    questions = question_list(n_docs)
    result = dict(
        command=command or default_command(out, clients, duration_s, soak_s, redis_down_s, threads, model),
        commit=git_commit(), uncommitted_changes=uncommitted_changes(), started=now(), finished=None,
        host=dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version()),
        config=dict(model=model, clients=clients, duration_s=duration_s, soak_s=soak_s, redis_down_s=down_s,
                    redis_down_at_s=soak_s / 3, max_tokens=max_tokens, temperature=0, threads=threads, workers=workers,
                    queue=queue, timeout_s=timeout, kvmem_options=KVMEM_OPTIONS, kvmem_store_options=STORE_OPTIONS,
                    system_prompt_tokens=n_system, system_prompt_documents=n_docs, questions=len(questions),
                    soak_questions=SOAK_QUESTIONS, rss_every_s=RSS_EVERY_S, retry_after_cap_s=RETRY_AFTER_CAP_S,
                    phases=list(phases)),
        system_prompt=system, phases={})
    result["runs"] = [dict(command=result["command"], phases=list(phases), commit=result["commit"], started=result["started"])]
    previous = out / "load.json"
    if previous.exists():
        keep_previous(result, json.loads(previous.read_text()))
    log(f"load test: {clients} clients, {duration_s:g} s per phase, system prompt {n_system} tokens ({n_docs} documents)")

    def save() -> None:
        (out / "load.json").write_text(json.dumps(result, indent=1))

    def serve(store: str | None, log_name: str):
        return serving(model, store, out / f"server-{log_name}.log", threads, workers, queue, timeout, health_timeout_s)

    def load_phase(name: str, store: str | None, seconds: float, during: Callable | None = None,
                   ask: Callable[[int], str] | None = None) -> dict:
        """One server, the warm-up, `clients` loops for `seconds` (with `during` beside them)."""
        log(f"{name}: kvmem serve --store {store or '(none)'}")
        started = now()
        with serve(store, name) as srv:
            log(f"  ready in {srv['ready_s']:.1f} s (pid {srv['pid']}, port {srv['port']})")
            metrics_start = scrape_metrics(srv["base"])
            options = KVMEM_OPTIONS | (STORE_OPTIONS if store else {})
            run = asyncio.run(drive(srv["base"], srv["pid"], served_name(srv, model), system, questions, clients, seconds,
                                    max_tokens, timeout + 30, options, during, log, ask))
            metrics_end = scrape_metrics(srv["base"])
        phase = dict(name=name, store=store, kvmem_options=options, started=started, finished=now(),
                     duration_s=seconds, server=srv, metrics_start=metrics_start, metrics_end=metrics_end, **run)
        phase.update(phase.pop("events") or {})
        steady = [r for r in run["requests"] if not r["warmup"]]
        ok = [r for r in steady if r["status"] == "ok"]
        log(f"  {len(ok)} ok of {len(steady)} steady-state requests; "
            f"{sum(r['status'] == '429' for r in steady)} x 429, {sum(r['status'] == 'error' for r in steady)} errors")
        return phase

    try:
        for name in phases:
            if name == "batching":
                log(f"batching: batch size 1 vs {BATCH} in this process ({threads} threads)")
                phase = batching_phase(model, system, threads, log=log)
            elif name in ("replicas", "cluster_replicas"):
                phase = replicas_phase(serve, model, tokenizer, system_tokens, questions, max_tokens, timeout,
                                       cluster=name == "cluster_replicas", log=log)
            elif name == "cluster_soak":
                phase = cluster_soak_phase(serve, load_phase, model, system, questions, max_tokens, timeout, soak_s, down_s, log)
            elif name == "soak":
                redis.start()
                phase = load_phase(name, redis.url, soak_s, redis_outage(redis.kill, redis.start, soak_s / 3, down_s, log))
                redis.kill()
            else:
                phase = load_phase(name, {"store_on": "memory", "store_off": None}[name], duration_s)
            result["phases"][name] = phase | {"config": result["config"]}
            save()
    finally:
        if redis is not None:
            redis.kill()
        result["finished"] = now()
        save()
    return write_report(out)


def keep_previous(result: dict, old: dict) -> None:
    """Into `result` (a run starting), the phases of an earlier run (`old`, its load.json) that this one does not
    run, if the workload is the same (model, system prompt, answer length); the report lists both commands. Each
    phase keeps the config of the run that made it (clients, durations, workers may differ)."""
    same = all(old.get("config", {}).get(k) == result["config"][k] for k in ("model", "system_prompt_tokens", "max_tokens"))
    if not same:
        return
    run = result["config"]["phases"]
    kept = {k: {**v, "config": v.get("config", old["config"])} for k, v in old["phases"].items() if k not in run}
    result["phases"].update(kept)
    result["runs"] = [r for r in old.get("runs", [dict(command=old["command"], phases=list(old["phases"]),
                                                        commit=old["commit"], started=old["started"])])
                      if set(r["phases"]) & set(kept)] + result["runs"]


def served_name(srv: dict, model: str) -> str:
    """The model name to send to a server: ours, or the first it serves (under another name)."""
    return model if not srv["served_models"] or model in srv["served_models"] else srv["served_models"][0]


def replicas_phase(serve: Callable, model: str, tokenizer, system_tokens: int, questions: list[str], max_tokens: int,
                   timeout: float, cluster: bool = False, log=print) -> dict:
    """Two servers (`serve(store, log name)`) on one local redis-server, or with `cluster` on a three-node Redis
    Cluster; `replica_pairs` over knowledge bases made of abstracts the other phases do not use. On the cluster,
    each pair also records the keys per node before A and after it (what A wrote, and where it landed)."""
    from kvmem.store.tiers import LocalRedis, LocalRedisCluster

    systems, first = [], 40  # abstracts from the 40th on: none of them is in the other phases' prompt
    for k in range(REPLICA_PROMPTS):
        text, _, n_docs = knowledge_base(tokenizer, system_tokens, first)
        systems.append(text)
        first += n_docs
    name, where = ("cluster_replicas", "a three-node Redis Cluster") if cluster else ("replicas", "one redis-server")
    log(f"{name}: two kvmem serve --store memory,{'redis+cluster' if cluster else 'redis'}://... on {where}, "
        f"{len(systems)} knowledge bases")
    started = now()
    with (LocalRedisCluster() if cluster else LocalRedis()) as redis:
        store = f"memory,{redis.url}"
        prefix = "cluster-replica" if cluster else "replica"
        with serve(store, f"{prefix}-a") as a, serve(store, f"{prefix}-b") as b:
            pairs = asyncio.run(replica_pairs(a["base"], b["base"], served_name(a, model), systems, questions, max_tokens,
                                              timeout + 30, KVMEM_OPTIONS | STORE_OPTIONS, log,
                                              redis.keys_per_node if cluster else None))
            metrics = {"a": scrape_metrics(a["base"]), "b": scrape_metrics(b["base"])}
    kind = "redis+cluster://(local, 3 nodes)" if cluster else "redis://(local)"
    return dict(name=name, store=f"memory,{kind}", started=started, finished=now(), servers=[a, b], pairs=pairs,
                metrics_end=metrics)


def cluster_soak_phase(serve: Callable, load_phase: Callable, model: str, system: str, questions: list[str],
                       max_tokens: int, timeout: float, soak_s: float, down_s: float, log=print) -> dict:
    """The reference answers (a server without a store, each of the soak's questions once), then the soak on a
    three-node cluster (`load_phase`) with one node (`node_to_kill`) killed a third of the way in and restarted
    `down_s` later. The phase keeps the reference, the chunks per node at the kill and the keys per node at the end."""
    from kvmem.store.tiers import LocalRedisCluster

    asks = questions[:SOAK_QUESTIONS]
    ask = lambda k: asks[k % len(asks)]  # noqa: E731
    log(f"cluster_soak: reference answers without a store ({len(asks)} questions, one at a time)")
    with serve(None, "cluster-soak-reference") as srv:
        reference = asyncio.run(reference_answers(srv["base"], served_name(srv, model), system, asks, max_tokens,
                                                  timeout + 30))
    log(f"  {sum(r['status'] == 'ok' for r in reference)} of {len(reference)} answered")
    with LocalRedisCluster() as cluster:
        picked: dict = {}

        def pick() -> dict:
            starts = chunk_starts(cluster)
            picked["node"], why = node_to_kill(starts)
            return dict(node=picked["node"], node_port=cluster.ports[picked["node"]], why_this_node=why,
                        keys_per_node_at_kill=cluster.keys_per_node(), chunk_starts_at_kill=starts)

        outage = redis_outage(lambda: cluster.kill(picked["node"]), lambda: cluster.restart(picked["node"]), soak_s / 3,
                              down_s, log, "a cluster node", pick)
        phase = load_phase("cluster_soak", cluster.url, soak_s, outage, ask)
        phase["keys_per_node_at_end"] = cluster.keys_per_node()
    phase["reference"] = dict(server=srv, requests=reference)
    return phase


def chunk_starts(cluster) -> list[list[int]]:
    """Per node of a `LocalRedisCluster`, the first token of each chunk it holds (read from the chunk frames'
    verified headers), sorted; [] for a node that cannot be read."""
    import redis

    from kvmem.store.chunk import unpack

    out = []
    for port in cluster.ports:
        try:
            with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0, socket_connect_timeout=2.0) as r:
                blobs = [r.get(k) for k in r.scan_iter(match="kvmem:*")]
                out.append(sorted(unpack(b, views=True)[1]["start"] for b in blobs if b is not None))
        except (redis.RedisError, OSError):
            out.append([])
    return out


def node_to_kill(starts: list[list[int]]) -> tuple[int, str]:
    """The node whose outage tests the mixed path: not the one holding the prompt's first chunk (its outage makes
    every request a full recompute, as the one-Redis soak does) but the one holding the earliest chunk after it,
    so that requests load the chunks before that one from the live nodes and compute the rest. With every chunk
    on the first chunk's node, that node. Returns (node, why)."""
    first = next((i for i, s in enumerate(starts) if 0 in s), None)
    others = [(min(s), i) for i, s in enumerate(starts) if s and i != first]
    if others:
        start, node = min(others)
        return node, (f"holds the earliest chunk (token {start}) not on node {first}, the first chunk's: requests load "
                      f"tokens [0, {start}) from the live nodes and compute the rest")
    if first is None:
        raise KVMemError("no chunk of the soak's prompt is in the cluster at the kill: nothing to take down")
    return first, "holds every chunk (the first included): requests compute the whole prompt"


async def reference_answers(base: str, model: str, system: str, asks: list[str], max_tokens: int,
                            request_timeout_s: float) -> list[dict]:
    """Each question once, one at a time, with `KVMEM_OPTIONS` only (the server has no store)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=request_timeout_s)
    try:
        return [dict(question=q, **await one_request(client, model, system, q, max_tokens, KVMEM_OPTIONS)) for q in asks]
    finally:
        await client.close()


def batching_phase(model: str, system: str, threads: int, repeats: int = 3, log=print) -> dict:
    """Decode tokens/s at batch size 1 (one answer after another) and `BATCH` (one batch), on one prefilled prompt."""
    import torch

    from kvmem.compress import get_method
    from kvmem.forward import feed
    from kvmem.generate import answer_batch, new_cache
    from kvmem.models import load_model
    from kvmem.prompts import chat_prompt

    torch.set_num_threads(threads)
    lm = load_model(model)
    prompt = chat_prompt(lm.tokenizer, [{"role": "system", "content": system},
                                        {"role": "user", "content": "Count from 1 to 200, separated by commas."}])
    cache = new_cache(lm, get_method("full"))
    feed(lm, cache, prompt.context)
    runs = []
    for _ in range(repeats):  # alternated, so that a slow spell of the machine hits both
        t = time.perf_counter()
        single = [answer_batch(lm, [cache], prompt.question, BATCHING_TOKENS, stop_at_newline=False)[0]
                  for _ in range(BATCH)]
        t_single = time.perf_counter() - t
        t = time.perf_counter()
        batched = answer_batch(lm, [cache] * BATCH, prompt.question, BATCHING_TOKENS, stop_at_newline=False)
        t_batched = time.perf_counter() - t
        runs.append(dict(single_s=t_single, single_tokens=sum(map(len, single)), batched_s=t_batched,
                         batched_tokens=sum(map(len, batched)), same_tokens=single == batched))
        log(f"  batch 1: {runs[-1]['single_tokens'] / t_single:.1f} tokens/s; batch {BATCH}: "
            f"{runs[-1]['batched_tokens'] / t_batched:.1f} tokens/s")
    return dict(name="batching", batch=BATCH, tokens_per_row=BATCHING_TOKENS, threads=threads,
                context_tokens=len(prompt.context), runs=runs)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(prog="python -m kvmem_bench.serve.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("results/serve"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=120, help="seconds of load in each of store on / store off")
    p.add_argument("--soak", type=float, default=180,
                   help="seconds of each soak (Redis, and the cluster with a node) with an outage (0: none)")
    p.add_argument("--redis-down", type=float, default=None,
                   help="seconds Redis (or the cluster's node) is down (default min(20, soak/3))")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--queue", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--phases", default=",".join(PHASES))
    args = p.parse_args(argv)
    command = shlex.join(["python", "-m", "kvmem_bench.serve.runner", *(sys.argv[1:] if argv is None else argv)])
    report = run_load_suite(args.out, args.model, args.clients, args.duration, args.soak, args.redis_down, args.max_tokens,
                            args.system_tokens, args.threads, args.workers, args.queue, args.timeout,
                            phases=tuple(s.strip() for s in args.phases.split(",") if s.strip()), command=command)
    print(report)
    return report


if __name__ == "__main__":
    main()

"""The continuous-batching benchmark (`make bench-batching`): what batching turns freed KV memory into.

Phases, each its own server on loopback, one after another (never side by side: on 2 cores they would time each
other), every request a streaming chat completion (the openai client; `kvmem_bench.serve.harness.one_request`) at temperature 0
with `ignore_eos`, so every request decodes exactly `max_tokens`:

* `sweep`: closed-loop clients (each sends its next request when the last ends) at each concurrency for
  `duration` seconds, on a knowledge base of ~1k and ~4k tokens in the system prompt and a different question per
  request, against three servers on the same model files: kvmem without batching (`--no-batching`, one worker:
  what kvmem served before), kvmem with continuous batching, and `transformers serve` (transformers' own server with
  continuous batching). kvmem runs with its store (the knowledge base is computed once and loaded by every
  request, as a deployment would run it); whether transformers reused any prompt tokens is recorded.
  Output tokens/s, requests/s, TTFT and inter-token latency per (server, length, concurrency).
* `memory`: the memory-bound case. kvmem with continuous batching and a fixed `--kv-budget` (256 MiB), a ~4k-token
  knowledge base and `memory_clients` clients, once per cache configuration (full, kvzip@0.25, keydiff@0.25,
  kivi-4, kvzip@0.25 + kivi-4, kvzip@0.5 + kivi-4 / kivi-8): how many sequences ran at once (the server's `kvmem_batch_rows`, sampled) and the
  tokens/s that gave. The compressed context is stored compressed and reused whole by later requests.

* `steps`: in-process, ms per decode step of 1, 4 and 16 rows of 1k tokens (equal lengths, and four different
  lengths), each row attending its own cache in place (`RowBatch`, what the scheduler runs) against the rows copied
  into one padded batch (`BatchedCache`): the padding overhead; and of 16 rows held by each quantization scheme
  against full precision, and evicted to heads of different lengths, read by the kernel or by SDPA head by head.

The server's /metrics are sampled every 0.25 s (rows in the batch, KV bytes held, preemptions). Everything goes to
OUT/batching.json, written after each phase; `kvmem_bench.batching.report` makes OUT/report.md and the plots.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
import urllib.error
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from kvmem.errors import KVMemError
from kvmem_bench.batching.steps import step_times
from kvmem_bench.records import git_commit, now, uncommitted_changes
from kvmem_bench.serve.harness import (get, knowledge_base, load_tokenizer, one_request, parse_prometheus, question,
                                       question_list)

SERVERS = ("kvmem-single", "kvmem-batching", "transformers")
MEMORY_CONFIGS = {  # name: the request's kvmem options
    "full": {},
    "kvzip@0.25": {"method": "kvzip", "keep_ratio": 0.25},
    "keydiff:kernel_size=33@0.25": {"method": "keydiff:kernel_size=33", "keep_ratio": 0.25},
    "kivi-4": {"quant": "kivi-4"},
    "kvzip@0.25+kivi-4": {"method": "kvzip", "keep_ratio": 0.25, "quant": "kivi-4"},
    "kvzip@0.5+kivi-4": {"method": "kvzip", "keep_ratio": 0.5, "quant": "kivi-4"},
    "kvzip@0.5+kivi-8": {"method": "kvzip", "keep_ratio": 0.5, "quant": "kivi-8"},
}
METRICS_EVERY_S = 0.25


@contextmanager
def kvmem_server(model: str, args: list[str], log: Path, threads: int) -> Iterator[dict]:
    from kvmem.serve.local import LocalServer

    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with LocalServer(["--threads", str(threads), "--timeout", "900", *args], model, log, 600, env) as server:
        yield dict(base=server.url, pid=server.pid, command=server.command, model=model)


@contextmanager
def transformers_server(model: str, log: Path, threads: int) -> Iterator[dict]:
    """`transformers serve` with continuous batching on the same converted model folder kvmem loads, offline."""
    from kvmem.models import _converted_folder
    from kvmem.serve.local import free_port

    from transformers import AutoConfig

    folder = str(_converted_folder(model))
    port = free_port()
    # its KV pool sized like kvmem's default budget (a quarter of RAM; its own default is 60 %), pages of 32 tokens
    # (prefix sharing is by whole pages: with its default 256 a shorter prefix is never shared) and prefill chunks
    # of 512 tokens like kvmem's pieces (its default batches up to 8192 tokens into one forward)
    text = AutoConfig.from_pretrained(folder).get_text_config()
    per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * getattr(
        text, "head_dim", text.hidden_size // text.num_attention_heads) * 4
    blocks = int(0.25 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (32 * per_token))
    argv = [str(Path(sys.executable).parent / "transformers"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--continuous-batching", "--device", "cpu", "--dtype", "float32", "--attn-implementation", "sdpa",
            "--cb-block-size", "32", "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "512",
            "--log-level", "warning", folder]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
                        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise KVMemError(f"transformers serve exited with {proc.returncode}: {log.read_text()[-1500:]}")
            try:
                if get(base + "/health", 2)[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise KVMemError("transformers serve did not answer /health within 600 s")
            time.sleep(0.5)
        # eos_token_id -1 (no token has it) is how its generate runs to max_tokens (kvmem's ignore_eos); it honours
        # neither min_new_tokens nor ignore_eos there
        yield dict(base=base, pid=proc.pid, command=" ".join(argv), model=folder,
                   extra_body={"generation_config": json.dumps({"eos_token_id": -1})})
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


RSS = "process_resident_memory_bytes"
STORE_BYTES = 'kvmem_store_bytes{tier="memory"}'
IDLE_S = 3.0  # the scheduler's idle turn comes within 0.5 s of its last row leaving


def settled(server: dict, timeout_s: float = 60) -> dict:
    """After a run: wait until the server holds no row and no KV (its gauges), then, once its scheduler has had
    `IDLE_S` to go idle (the freed heap goes back to the OS on its first idle turn: read before it, RSS still shows
    the peak), its RSS, the KV and the bytes its store's memory tier still hold."""
    deadline, m = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        try:
            m = parse_prometheus(get(server["base"] + "/metrics", 2)[1])
            if not m.get("kvmem_batch_rows") and not m.get("kvmem_kv_bytes_held") and not m.get("kvmem_swapped_rows") \
                    and not m.get("kvmem_queue_depth"):
                time.sleep(IDLE_S)
                m = parse_prometheus(get(server["base"] + "/metrics", 2)[1])
                break
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.5)
    return dict(rss=m.get(RSS, math.nan), rows=m.get("kvmem_batch_rows"), kv_bytes=m.get("kvmem_kv_bytes_held"),
                store_bytes=m.get(STORE_BYTES, math.nan))


async def _sample_metrics(base: str, t0: float, samples: list, stop: asyncio.Event) -> None:
    """kvmem's batch gauges every METRICS_EVERY_S: [t, rows in the batch, KV bytes held, preemptions so far, the
    server's RSS bytes]."""
    while not stop.is_set():
        try:
            m = parse_prometheus((await asyncio.to_thread(get, base + "/metrics", 2))[1])
            samples.append([round(time.perf_counter() - t0, 3), m.get("kvmem_batch_rows", 0.0),
                            m.get("kvmem_kv_bytes_held", 0.0), m.get("kvmem_preemptions", 0.0),
                            m.get(RSS, math.nan)])
        except (urllib.error.URLError, OSError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), METRICS_EVERY_S)
        except asyncio.TimeoutError:
            pass


async def closed_loop(server: dict, system: str, questions: list[str], clients: int, duration_s: float,
                      max_tokens: int, options: dict, first: int, kvmem_metrics: bool) -> dict:
    """`clients` loops for `duration_s`, each sending its next request when the last ended; times from t0."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="x", max_retries=0, timeout=1800)
    records, samples, stop = [], [], asyncio.Event()
    seq = iter(range(first, 10**9))
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample_metrics(server["base"], t0, samples, stop)) if kvmem_metrics else None

    async def loop(client_id: int, end_at: float) -> None:
        while time.perf_counter() < end_at:
            k = next(seq)
            start = time.perf_counter() - t0
            rec: dict = {}
            task = asyncio.ensure_future(one_request(client, server["model"], system, question(k, questions),
                                                     max_tokens, options, token_times=True, until=end_at, rec=rec,
                                                     extra_body=server.get("extra_body")))
            done, _ = await asyncio.wait({task}, timeout=max(end_at - time.perf_counter(), 0) + 0.5)
            if not done:  # still waiting for a chunk at the end of the run: cut, with what arrived
                task.cancel()
                rec |= dict(status="cut", completion_tokens=len(rec.get("chunk_s", [])),
                            latency_s=time.perf_counter() - t0 - start)
            records.append(dict(seq=k, client=client_id, t_start_s=round(start, 4),
                                t_end_s=round(start + rec["latency_s"], 4), **rec))
            if rec["status"] not in ("ok", "cut"):
                await asyncio.sleep(1.0)

    try:
        await asyncio.gather(*(loop(i, t0 + duration_s) for i in range(clients)))
        await asyncio.sleep(0.5)  # cut requests: let the server see their clients go
    finally:
        stop.set()
        if sampler:
            await sampler
        await client.close()
    return dict(clients=clients, duration_s=duration_s, t_stop_s=round(time.perf_counter() - t0, 4),
                requests=records, metrics=samples)


def joined_segments(segments: list[dict], segment_s: float) -> dict:
    """Closed-loop runs of one server made at different times, as one run: each segment's times follow the last's
    (`segment` says which a request was in; the report reads one window per segment and pairs segment k of two
    servers). Preemptions are the server's counter, so they add up across segments by themselves."""
    requests, metrics = [], []
    for k, seg in enumerate(segments):
        shift = k * segment_s
        requests += [r | {"t_start_s": round(r["t_start_s"] + shift, 4), "t_end_s": round(r["t_end_s"] + shift, 4),
                          "segment": k} for r in seg["requests"]]
        metrics += [[round(m[0] + shift, 3), *m[1:]] for m in seg["metrics"] if m[0] <= segment_s]
    return dict(clients=segments[0]["clients"], duration_s=segment_s * len(segments), segments=len(segments),
                segment_s=segment_s, requests=requests, metrics=metrics)


def _warm(server: dict, system: str, max_tokens: int, options: dict, log) -> dict:
    """One request alone: loads the model's lazy parts and fills the store with the knowledge base."""
    async def one():
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=f"{server['base']}/v1", api_key="x", max_retries=0, timeout=1800)
        try:
            return await one_request(client, server["model"], system, "Which documents are in this knowledge base?",
                                     max_tokens, options, extra_body=server.get("extra_body"))
        finally:
            await client.close()

    rec = asyncio.run(one())
    log(f"    warm-up: {rec['status']} TTFT {rec['ttft_s'] or float('nan'):.2f} s" +
        (f" ({rec['error']})" if rec["error"] else ""))
    if rec["status"] != "ok":
        raise KVMemError(f"the warm-up request failed: {rec['error']}")
    return rec


def run_batching_suite(out: Path, model: str = "smollm2-135m", lengths: tuple[int, ...] = (1024, 4096),
                       concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32), duration_s: float = 60, sweep_rounds: int = 1,
                       max_tokens: int = 64, threads: int = 2, servers: tuple[str, ...] = SERVERS,
                       memory_budget: str = "256MiB", memory_clients: int = 16, memory_duration_s: float = 180, memory_rounds: int = 3,
                       memory_configs: tuple[str, ...] = tuple(MEMORY_CONFIGS), phases: tuple[str, ...] = ("sweep", "memory", "steps"),
                       command: str | None = None, log=print) -> Path:
    from kvmem_bench.batching.report import write_report

    if unknown := set(servers) - set(SERVERS):
        raise KVMemError(f"unknown server(s) {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    if unknown := set(memory_configs) - set(MEMORY_CONFIGS):
        raise KVMemError(f"unknown cache configuration(s) {sorted(unknown)}; choose from {', '.join(MEMORY_CONFIGS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "batching.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    tokenizer = load_tokenizer(model)
    data["config"] = dict(model=model, threads=threads, max_tokens=max_tokens, cpus=os.cpu_count(),
                          machine=platform.machine(), commit=git_commit(), dirty=uncommitted_changes(), command=command)

    def save():
        path.write_text(json.dumps(data, indent=1))

    options = {"ignore_eos": True}
    if "sweep" in phases:
        for length in lengths:
            system, n_system, n_docs = knowledge_base(tokenizer, length)
            questions = question_list(n_docs)
            opts = {kind: options | ({"use_store": True, "fill_store": True} if kind != "transformers" else {})
                    for kind in servers}
            with ExitStack() as stack:
                # every server up at once, the load moving between them (see the memory phase: the machine drifts)
                up, first = {}, dict.fromkeys(servers, 0)
                for kind in servers:
                    log(f"sweep: {kind}, knowledge base of {n_system} tokens: starting and warming its server")
                    up[kind] = stack.enter_context(_server(kind, model, out / f"server-{kind}-{length}.log", threads))
                    _warm(up[kind], system, 4, opts[kind], log)
                for c in concurrencies:
                    segments = {kind: [] for kind in servers}
                    for k in range(sweep_rounds):
                        for kind in (servers if k % 2 == 0 else servers[::-1]):
                            run = asyncio.run(closed_loop(up[kind], system, questions, c, duration_s, max_tokens,
                                                          opts[kind], first[kind], kind != "transformers"))
                            first[kind] += len(run["requests"])
                            if kind != "transformers":  # (no gauges to wait on: its cut requests end with their clients)
                                settled(up[kind])
                            segments[kind].append(run)
                            ok = [r for r in run["requests"] if r["status"] == "ok"]
                            log(f"  {kind}, {c:>2} clients" + (f", round {k + 1}/{sweep_rounds}" if sweep_rounds > 1 else "")
                                + f": {len(ok)} ok of {len(run['requests'])}, "
                                f"{sum(r['completion_tokens'] for r in ok) / duration_s:.1f} tokens/s (finished requests)")
                    for kind in servers:
                        run = segments[kind][0] if sweep_rounds == 1 else joined_segments(segments[kind], duration_s)
                        data["runs"] = [r for r in data["runs"] if not (r["phase"] == "sweep" and r["server"] == kind and
                                                                        r["length"] == length and r["clients"] == c)]
                        data["runs"].append(dict(phase="sweep", server=kind, length=length, prompt_tokens=n_system,
                                                 command=up[kind]["command"], when=now(), commit=git_commit(),
                                                 dirty=uncommitted_changes(), **run))
                    save()
    if "memory" in phases:
        system, n_system, n_docs = knowledge_base(tokenizer, 4096)
        questions = question_list(n_docs)
        args = ["--kv-budget", memory_budget, "--store", "memory", "--queue", str(4 * memory_clients)]
        opts = {name: options | MEMORY_CONFIGS[name] | {"use_store": True, "fill_store": True} for name in memory_configs}
        with ExitStack() as stack:
            # every configuration's server stays up (idle ones cost nothing), the load moves between them in rounds:
            # this machine's speed drifts by tens of percent over minutes, so configurations run one after another
            # would compare different machines; round k of each is paired with round k of the full cache
            servers, idle, segments = {}, {}, {name: [] for name in memory_configs}
            for name in memory_configs:
                log(f"memory: {name}, --kv-budget {memory_budget}: starting and warming its server")
                servers[name] = stack.enter_context(kvmem_server(model, args, out / f"server-memory-{name}.log", threads))
                _warm(servers[name], system, 4, opts[name], log)
                idle[name] = settled(servers[name])  # the model, the store's one context, the kernel: before any load
            first = 0
            for k in range(memory_rounds):
                order = memory_configs if k % 2 == 0 else memory_configs[::-1]
                for name in order:
                    run = asyncio.run(closed_loop(servers[name], system, questions, memory_clients, memory_duration_s,
                                                  max_tokens, opts[name], first, True))
                    first += len(run["requests"])
                    settled(servers[name])  # its cut requests gone, its rows freed: idle before the next one runs
                    segments[name].append(run)
                    ok = [r for r in run["requests"] if r["status"] == "ok"]
                    log(f"  round {k + 1}/{memory_rounds} {name}: {len(ok)} ok of {len(run['requests'])}, "
                        f"{sum(r['completion_tokens'] for r in ok) / memory_duration_s:.1f} tokens/s (finished requests)")
            for name in memory_configs:
                run = joined_segments(segments[name], memory_duration_s)
                run["server_memory"] = dict(idle=idle[name], after=settled(servers[name]))
                after = run["server_memory"]["after"]
                log(f"  {name}: server RSS {idle[name]['rss'] / 2**20:.0f} MiB idle, {after['rss'] / 2**20:.0f} MiB after "
                    f"the load ({after['kv_bytes']} KV bytes still held; the store's memory tier "
                    f"{idle[name]['store_bytes'] / 2**20:.0f} -> {after['store_bytes'] / 2**20:.0f} MiB)")
                data["runs"] = [r for r in data["runs"] if not (r["phase"] == "memory" and r["config"] == name)]
                data["runs"].append(dict(phase="memory", server="kvmem-batching", config=name, options=opts[name],
                                         budget=memory_budget, length=4096, prompt_tokens=n_system,
                                         command=servers[name]["command"], when=now(), commit=git_commit(),
                                         dirty=uncommitted_changes(), **run))
            save()
    if "steps" in phases:
        log("steps: a decode step in-process, packed vs padded rows, and per quantization scheme")
        data["steps"] = step_times(model, threads, log=log) | dict(when=now(), commit=git_commit(), dirty=uncommitted_changes())
        save()
    return write_report(out)


@contextmanager
def _server(kind: str, model: str, log: Path, threads: int) -> Iterator[dict]:
    if kind == "transformers":
        with transformers_server(model, log, threads) as s:
            yield s
        return
    args = ["--store", "memory", "--queue", "64"]
    args += ["--no-batching", "--workers", "1"] if kind == "kvmem-single" else ["--kv-budget", "0.25"]
    with kvmem_server(model, args, log, threads) as s:
        yield s

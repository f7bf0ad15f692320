"""The speed and memory benchmark's run (see the package doc): memory probes in fresh processes, then the timings."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from kvmem.cache import KVCache, storage_bytes
from kvmem.compress import METHODS, Compressor, ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem_bench.stats import bootstrap_mean
from kvmem_bench.records import git_commit, uncommitted_changes
from kvmem_bench.speed import (COMPRESSED_KINDS, DECODE_KINDS, DEFAULT_LENGTHS, DEFAULT_MODELS, KEEP_RATIO, KIND_BUDGET,
                               WARMUP_TOKENS)
from kvmem_bench.speed.report import mib, plot_decode, report


@dataclass
class SpeedConfig:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    # decode-phase methods (moment-kv) keep the prompt whole: compressing after a prefill is nothing for them to time
    methods: list[str] = field(default_factory=lambda: [m for m, cls in METHODS.items()
                                                        if m != "full" and not cls.decode_phase])
    threads: int = 0  # torch CPU threads in every process (0: torch's default)
    out: Path = Path("results/speed")
    decode_steps: int = 32  # timed decode steps per cache kind
    warmup: int = 4  # untimed decode steps first
    memory_decode: int = 16  # tokens decoded in each memory process
    prefill_repeats: int = 1  # prefills per cache type (each repeat re-reads the whole context)
    compress_repeats: int = 3  # compressions per method, each on a fresh copy
    memory_jobs: int = 1  # memory processes run at once (they are not timed)
    # glibc's malloc raises its mmap threshold as big blocks are freed, then serves tensors from a heap it
    # does not give back: two runs of one configuration peaked 90-130 MiB apart (smollm2 @ 4096). A fixed
    # threshold (glibc's initial 128 KiB) returns freed tensors to the OS, so the peak is what was live.
    # None: glibc's default.
    malloc_mmap_threshold: int | None = 128 * 1024

    @property
    def room(self) -> int:
        """Tokens fed after the prefill in either measurement: a model's full context leaves room for them."""
        return max(self.warmup + self.decode_steps, self.memory_decode)

    def validate(self) -> None:
        for m in self.methods:
            if get_method(m).name == "full":
                raise KVMemError("the speed suite times compression; 'full' compresses nothing (leave it out)")
        if not self.models or not self.lengths:
            raise KVMemError("the speed suite needs at least one model and one length")
        if min(self.lengths) < 16:
            raise KVMemError(f"context lengths must be at least 16 tokens; got {min(self.lengths)}")
        if min(self.decode_steps, self.prefill_repeats, self.compress_repeats, self.memory_jobs) < 1 or self.warmup < 0:
            raise KVMemError("decode steps, repeats and memory jobs must be at least 1 (warm-up at least 0)")


# -- shared helpers ------------------------------------------------------------------------------------
def context_ids(tokenizer, n: int) -> list[int]:
    """`n` tokens of real text (the seed abstracts, repeated if needed), plus the token that follows them."""
    from kvmem.calibration import load_abstracts

    ids = tokenizer("\n\n".join(load_abstracts())).input_ids
    while len(ids) < n + 1:
        ids = ids + ids[1:]
    return ids[: n + 1]


def context_tokens(lm, length: int, room: int) -> int:
    """The prefill length for `length`: at most the model's context minus `room` tokens decoded after it."""
    return min(length, lm.max_context - room)


def kv_bytes(cache) -> int:
    """Bytes held by keys and values: `KVCache.kv_bytes()`, or the distinct storages of a DynamicCache's layers."""
    if isinstance(cache, KVCache):
        return cache.kv_bytes()
    return storage_bytes(t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))


def ragged_layers(cache) -> int:
    """Layers whose heads hold different numbers of tokens (kvmem's per-head storage)."""
    return sum(len(set(layer.lengths())) > 1 for layer in cache.layers) if isinstance(cache, KVCache) else 0


def new_cache(lm, kind: str):
    from transformers import DynamicCache

    if kind == "dynamic":
        return DynamicCache(config=lm.model.config)
    if kind in ("kvmem", "kvmem-full"):
        return KVCache(lm.model.config)
    if kind == "kvmem-tracked":
        return KVCache(lm.model.config, track_attention=True)
    if kind in COMPRESSED_KINDS:  # each layer compressed right after its prefill attention
        return KVCache(lm.model.config, compressor=Compressor(get_method(f"snapkv:budget={KIND_BUDGET[kind]}"), KEEP_RATIO))
    raise KVMemError(f"unknown cache kind {kind!r}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _proc_status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so the peak measured next excludes model loading."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- memory: one fresh process per configuration ------------------------------------------------------
def memory_probe(model: str, length: int, kind: str, threads: int, decode: int, room: int) -> dict:
    """Load `model`, prefill `length` tokens into a `kind` cache, decode `decode` tokens; measured bytes."""
    from transformers.utils import logging as hf_logging

    from kvmem.forward import feed
    from kvmem.models import load_model

    hf_logging.disable_progress_bar()
    if threads:
        torch.set_num_threads(threads)
    lm = load_model(model)
    n = context_tokens(lm, length, room)
    ids = context_ids(lm.tokenizer, n)
    gc.collect()
    rss_loaded = _proc_status_kib("VmRSS")
    reset = _reset_peak_rss()
    cache = new_cache(lm, kind)
    feed(lm, cache, ids[:n])
    for _ in range(decode):
        feed(lm, cache, ids[n:])
    peak = _proc_status_kib("VmHWM")
    return dict(model=model, length=length, context_tokens=n, max_context=lm.max_context, measure="memory", cache=kind,
                kv_bytes=kv_bytes(cache), ragged_layers=ragged_layers(cache),
                rss_loaded_bytes=rss_loaded * 1024 if rss_loaded is not None else None,
                peak_rss_bytes=peak * 1024 if peak is not None else None, peak_excludes_loading=reset,
                ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                decoded=decode, threads=torch.get_num_threads(),
                malloc_mmap_threshold=os.environ.get("MALLOC_MMAP_THRESHOLD_"))


def run_memory(cfg: SpeedConfig, log=print) -> list[dict]:
    """One fresh process per (model, length, cache kind), forked from a server that has only imported
    kvmem, torch and transformers (multiprocessing's forkserver): seconds of imports saved per process,
    nothing else shared with this one."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["kvmem_bench.speed.runner", "kvmem.generate", "kvmem.models"])
    jobs = [(m, L, k, cfg.threads, cfg.memory_decode, cfg.room) for m in cfg.models for L in cfg.lengths
            for k in DECODE_KINDS]
    rows = []
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if cfg.malloc_mmap_threshold is not None:  # read by glibc when the forkserver starts; its children inherit it
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(cfg.malloc_mmap_threshold)
    try:
        with ctx.Pool(min(cfg.memory_jobs, len(jobs)), maxtasksperchild=1) as pool:
            for row in pool.imap(_probe, jobs):
                log(f"memory {row['model']} @ {row['context_tokens']} {row['cache']}: peak "
                    f"{mib(row['peak_rss_bytes'])}, loaded {mib(row['rss_loaded_bytes'])}, KV {mib(row['kv_bytes'])}")
                rows.append(row)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return rows


def _probe(args: tuple) -> dict:
    return memory_probe(*args)


# -- timing: one process per model ---------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


@torch.no_grad()
def time_model_length(lm, model: str, length: int, cfg: SpeedConfig, log=print) -> list[dict]:
    """Prefill, compression and decode timings of one model at one context length."""
    from kvmem.forward import feed

    n = context_tokens(lm, length, cfg.room)
    ids = context_ids(lm.tokenizer, n)
    base = dict(model=model, length=length, context_tokens=n, max_context=lm.max_context, threads=torch.get_num_threads())
    rows: list[dict] = []

    # Prefill: the three cache types one after the other, repeated, so drift hits all alike.
    prefill: dict[str, list[float]] = {"dynamic": [], "kvmem": [], "kvmem-tracked": []}
    caches: dict = {}
    for _ in range(cfg.prefill_repeats):
        for kind in prefill:
            caches[kind] = None
            gc.collect()
            cache = new_cache(lm, kind)
            prefill[kind].append(_timed(lambda: feed(lm, cache, ids[:n])))
            caches[kind] = cache
    for kind, secs in prefill.items():
        rows.append(dict(base, measure="prefill", cache=kind, seconds=secs, median_s=_median(secs),
                         kv_bytes=kv_bytes(caches[kind])))
    untracked_s = _median(prefill["kvmem"])
    log(f"prefill {model} @ {n}: " + ", ".join(f"{k} {_median(v):.2f}s" for k, v in prefill.items()))

    # Compression on copies (the copy is not timed); h2o needs the tracked cache. First, untimed, each method
    # compresses a short cache, so calibration artefacts (q-filters, kvzip-head, duo/razor probes) are fitted
    # or loaded before the clock runs. Methods that run the model are timed once: a reconstruction is long
    # enough not to need repeats, and kvzip at 8k tokens takes minutes.
    decode_caches = {"dynamic": caches.pop("dynamic"), "kvmem-full": caches["kvmem"]}
    warm = KVCache(lm.model.config, track_attention=True)
    feed(lm, warm, ids[:WARMUP_TOKENS])
    for spec in cfg.methods + ["snapkv:budget=adaptive"]:
        m = get_method(spec)
        method, budget = m.name, m.budget
        src = caches["kvmem-tracked"] if m.needs_attention else caches["kvmem"]
        secs = []
        try:
            compress(warm.clone(), m, KEEP_RATIO, context=ModelContext(lm, ids[:WARMUP_TOKENS]))
            for _ in range(1 if m.needs_model else cfg.compress_repeats):  # a fresh context: kvzip reconstructs each time
                c = src.clone()
                secs.append(_timed(lambda c=c: compress(c, m, KEEP_RATIO, context=ModelContext(lm, ids[:n]))))
        except KVMemError as e:  # e.g. kvzip at a model's full context: no room to reconstruct
            log(f"compress {model} @ {n}: {m.spec} skipped: {e}")
            rows.append(dict(base, measure="skipped", method=method, budget=budget, reason=str(e)))
            continue
        rows.append(dict(base, measure="compress", method=method, budget=budget, keep_ratio=KEEP_RATIO, seconds=secs,
                         median_s=_median(secs), fraction_of_prefill=_median(secs) / untracked_s,
                         needs_model=m.needs_model, kv_bytes=kv_bytes(c), kv_bytes_full=kv_bytes(src),
                         ragged_layers=ragged_layers(c)))
        if method == "snapkv" and budget in ("uniform", "adaptive"):
            decode_caches["snapkv-0.25" if budget == "uniform" else "snapkv-0.25-adaptive"] = c
    caches.clear()
    log(f"compress {model} @ {n}: " + ", ".join(f"{r['method']}/{r['budget'][0]} {100 * r['fraction_of_prefill']:.2f}%"
                                                 for r in rows if r["measure"] == "compress"))

    # Decode, interleaved: every step feeds the same token to each cache, in a rotating order.
    for kind, cache in decode_caches.items():
        if isinstance(cache, KVCache):
            cache.drop_observations()
    ms: dict[str, list[float]] = {k: [] for k in DECODE_KINDS}
    token = ids[n:]
    for step in range(cfg.warmup + cfg.decode_steps):
        for i in range(len(DECODE_KINDS)):
            kind = DECODE_KINDS[(step + i) % len(DECODE_KINDS)]
            dt = _timed(lambda: feed(lm, decode_caches[kind], token))
            if step >= cfg.warmup:
                ms[kind].append(1000 * dt)
    for kind in DECODE_KINDS:
        q25, q75 = _quartiles(ms[kind])
        row = dict(base, measure="decode", cache=kind, ms=ms[kind], median_ms=_median(ms[kind]), q25_ms=q25, q75_ms=q75,
                   kv_bytes=kv_bytes(decode_caches[kind]), ragged_layers=ragged_layers(decode_caches[kind]))
        if kind != "dynamic":  # per-step paired ratio to DynamicCache; geometric mean with a bootstrap CI
            logs = [math.log(a / b) for a, b in zip(ms[kind], ms["dynamic"])]
            est, lo, hi = bootstrap_mean(logs)
            row.update(ratio_to_dynamic=math.exp(est), ratio_lo=math.exp(lo), ratio_hi=math.exp(hi))
        rows.append(row)
    log(f"decode {model} @ {n}: " + ", ".join(f"{k} {_median(v):.1f} ms" for k, v in ms.items()))
    return rows


# -- the run -------------------------------------------------------------------------------------------
def run_speed(cfg: SpeedConfig, progress: bool = True) -> Path:
    """Memory probes, then timings per model; writes OUT/results.json, report.md and decode_ms.png."""
    from kvmem.models import load_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    t0 = time.perf_counter()
    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
                uncommitted_changes=uncommitted_changes(),
                threads=torch.get_num_threads(), torch=torch.__version__, machine=platform.machine(),
                cpus=os.cpu_count(), keep_ratio=KEEP_RATIO, load_average_start=os.getloadavg(),
                config={k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()})
    rows = run_memory(cfg, log)  # first: the forkserver starts while this process is small
    for model in cfg.models:
        lm = load_model(model)
        for length in cfg.lengths:
            rows += time_model_length(lm, model, length, cfg, log)
            gc.collect()
        del lm
        gc.collect()
    meta.update(load_average_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
    cfg.out.mkdir(parents=True, exist_ok=True)
    rows, meta = merge_runs(cfg.out / "results.json", rows, meta)
    (cfg.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot = plot_decode(rows, cfg.out / "decode_ms.png")
    (cfg.out / "report.md").write_text(report(rows, meta, plot))
    return cfg.out


def merge_runs(previous: Path, rows: list[dict], meta: dict) -> tuple[list[dict], dict]:
    """This run's rows replace the (model, length) pairs it measured; an earlier run's other pairs are kept,
    its meta listed under `earlier_runs`."""
    if not previous.exists():
        return rows, meta
    try:
        old = json.loads(previous.read_text())
        old_rows, old_meta = old["rows"], old["meta"]
    except (ValueError, KeyError, TypeError) as e:
        raise KVMemError(f"{previous} is not a speed results file ({e}); move it away to start afresh") from None
    done = {(r["model"], r["length"]) for r in rows}
    kept = [r for r in old_rows if (r["model"], r["length"]) not in done]
    earlier = old_meta.get("earlier_runs", []) + [{k: v for k, v in old_meta.items() if k != "earlier_runs"}]
    return kept + rows, {**meta, "earlier_runs": earlier} if kept else meta

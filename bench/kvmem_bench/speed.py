"""Speed and memory benchmark: `kvmem eval --suite speed`.

Per model and context length, in one process (so machine noise hits every configuration alike):

* **prefill** time into transformers' `DynamicCache`, kvmem's `KVCache` (untracked) and `KVCache(...,
  track_attention=True)` (what h2o needs), run one after the other;
* **compress** time of every method (keep ratio 0.25, uniform budget; snapkv also adaptive) on a copy of
  the prefilled cache, the copy not timed, as a fraction of the untracked prefill (goal: <= 5%);
* **decode** ms per token (feeding the same token with `logits_to_keep=1`, as `kvmem.forward.feed`
  does) from a `DynamicCache`, a full `KVCache`, and `KVCache`s compressed to 0.25 with snapkv, uniform
  and adaptive (heads hold different numbers of tokens: the ragged storage path), interleaved step by
  step. Goal: decode from a compressed cache is no slower than from `DynamicCache`. kvmem caches drop
  their scorer observations before decoding, as `kvmem.generate.answer` does after compressing.

And **memory**, one fresh process per (model, length, cache kind): load, prefill (compressed kinds compress
each layer right after its prefill attention, via `Compressor`, which is how a user saves memory), decode
16 tokens. Peak RSS is read from /proc/self/status (VmHWM, reset after the model is loaded, so it is the
prefill + decode peak); `ru_maxrss` (the whole process, loading included) is recorded too. These processes
run with a fixed malloc mmap threshold (`SpeedConfig.malloc_mmap_threshold`, see there). The processes
are forked from multiprocessing's forkserver, not spawned from the benchmark itself, because Linux starts
a child's `ru_maxrss` at its parent's RSS (across fork and exec): from a process holding models and
caches it would report the parent's size.

SmolLM2's context is 8192 tokens: its 8192 length runs at 8192 minus the tokens decoded after it.
"""

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

KEEP_RATIO = 0.25
COMPRESS_GOAL = 0.05  # compression may add at most this fraction of the (untracked) prefill time
WARMUP_TOKENS = 64  # the short cache each method compresses once, untimed, before it is timed
DECODE_KINDS = ("dynamic", "kvmem-full", "snapkv-0.25", "snapkv-0.25-adaptive")
COMPRESSED_KINDS = ("snapkv-0.25", "snapkv-0.25-adaptive")
KIND_BUDGET = {"snapkv-0.25": "uniform", "snapkv-0.25-adaptive": "adaptive"}
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
DEFAULT_LENGTHS = (2048, 4096, 8192)


@dataclass
class SpeedConfig:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if m != "full"])
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


def _uncommitted_source() -> bool | None:
    """Whether kvmem's tracked source files differ from the recorded commit (None: not a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "."], capture_output=True,
                             text=True, cwd=Path(__file__).parents[1], timeout=5)
    except OSError:
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


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
    ctx.set_forkserver_preload(["kvmem_bench.speed", "kvmem.generate", "kvmem.models"])
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
                    f"{_mib(row['peak_rss_bytes'])}, loaded {_mib(row['rss_loaded_bytes'])}, KV {_mib(row['kv_bytes'])}")
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
    from kvmem_bench.longctx import git_commit
    from kvmem.models import load_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if progress else (lambda s: None)
    t0 = time.perf_counter()
    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
                uncommitted_changes=_uncommitted_source(),
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


# -- report --------------------------------------------------------------------------------------------
def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f} MiB"


def _groups(rows: list[dict], measure: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["measure"] == measure:
            out.setdefault((r["model"], r["length"]), []).append(r)
    return dict(sorted(out.items()))


def goals(rows: list[dict]) -> dict[str, dict]:
    """The two goals, checked on the measurements: met / not met and the numbers behind each."""
    # methods that run the model (kvzip's reconstruction) cost a multiple of the prefill by design: reported apart
    compress_rows = [r for r in rows if r["measure"] == "compress" and not r.get("needs_model")]
    over = [r for r in compress_rows if r["fraction_of_prefill"] > COMPRESS_GOAL]
    worst = max(compress_rows, key=lambda r: r["fraction_of_prefill"], default=None)
    ratio_rows = [r for r in rows if r["measure"] == "decode" and r["cache"] in COMPRESSED_KINDS]
    # "No slower": the geometric-mean ratio is <= 1, or its 95% interval includes 1 (not measurably slower).
    slower = [r for r in ratio_rows if r["ratio_lo"] > 1.0]
    return {
        "compress": dict(met=bool(compress_rows) and not over, checked=len(compress_rows),
                         over=[(r["model"], r["context_tokens"], r["method"], r["budget"], r["fraction_of_prefill"])
                               for r in over],
                         worst=worst and (worst["model"], worst["context_tokens"], worst["method"], worst["budget"],
                                          worst["fraction_of_prefill"])),
        "decode": dict(met=bool(ratio_rows) and not slower, checked=len(ratio_rows),
                       slower=[(r["model"], r["context_tokens"], r["cache"], r["ratio_to_dynamic"]) for r in slower]),
    }


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def speed_section(rows: list[dict]) -> list[str]:
    """Markdown lines: how it was measured, the two goals, then decode, prefill / compression and memory
    tables per model x context length (from the rows of results.json)."""
    g = goals(rows)
    threads = sorted({r["threads"] for r in rows})
    lines = ["## Speed and memory", "",
             f"torch with {', '.join(map(str, threads))} thread(s). Prefill, compression and decode are timed in one "
             "process per model, the configurations interleaved; decode feeds the same token each step with "
             "`logits_to_keep=1`, and kvmem caches drop their scorer observations before decoding (as "
             f"`answer()` does). Compressed caches keep {KEEP_RATIO} of each layer's tokens with snapkv; adaptive: "
             "a layer's heads share its budget, so they hold different numbers of tokens (the ragged storage path). "
             "A model with one KV head per layer (Gemma-3-270M) has nothing to share: there adaptive equals uniform. "
             "Memory: one fresh process per row (load, prefill, decode); peak RSS is VmHWM reset after the model "
             "is loaded, so it is the prefill + decode peak; " + _malloc_note(rows) + ".", ""]
    for r in {r["model"]: r for r in rows if r["context_tokens"] < r["length"]}.values():  # lengths cut to fit
        lines += [f"{r['model']}'s context is {r['max_context']} tokens: its {r['length']}-token length runs at "
                  f"{r['context_tokens']} tokens, leaving room for the tokens decoded after the prefill.", ""]
    c, d = g["compress"], g["decode"]
    w = c["worst"]
    lines.append(f"* **Compression adds <= {COMPRESS_GOAL:.0%} to prefill** (tracking excluded): {_met(c['met'])}; "
                 f"{len(c['over'])} of {c['checked']} (model, length, method) above"
                 + (f"; the slowest is {w[2]} ({w[3]}) on {w[0]} @ {w[1]} tokens, {100 * w[4]:.2f}% of the untracked "
                    "prefill." if w else "."))
    runs_model = [r for r in rows if r["measure"] == "compress" and r.get("needs_model")]
    if runs_model:
        lines.append("* Methods that run the model (reconstruction, RoPE or calibration; not in the goal above) cost, "
                     "as a multiple of the untracked prefill, paid once for a cache that is then reused: "
                     + "; ".join(f"{r['method']}{'' if r['budget'] == get_method(r['method']).budget else ':budget=' + r['budget']}"
                                 f" {r['fraction_of_prefill']:.2f}x on {r['model']} @ {r['context_tokens']}"
                                 for r in runs_model) + ".")
    tracked = [(r["model"], r["context_tokens"], r["median_s"] / u["median_s"]) for r in rows for u in rows
               if r["measure"] == u["measure"] == "prefill" and r["cache"] == "kvmem-tracked" and u["cache"] == "kvmem"
               and (r["model"], r["length"]) == (u["model"], u["length"])]
    lines.append("* h2o also needs the prefill tracked (`track_attention=True`), reported apart: tracked / untracked "
                 "prefill time " + ", ".join(f"{m} @ {n} {x:.2f}x" for m, n, x in tracked) + ".")
    ratios = [r for r in rows if r["measure"] == "decode" and r["cache"] in COMPRESSED_KINDS]
    lines.append(f"* **Decode from a compressed cache is no slower than from DynamicCache**: {_met(d['met'])} (met "
                 "when the geometric mean of the per-step ratios is <= 1 or its 95% bootstrap interval includes 1); "
                 "compressed / DynamicCache ms per token: "
                 + "; ".join(f"{r['model']} @ {r['context_tokens']} {r['cache']} {r['ratio_to_dynamic']:.2f} "
                             f"[{r['ratio_lo']:.2f}, {r['ratio_hi']:.2f}]" for r in ratios) + ".")
    lines += ["", "### Decode (ms per token: median [quartiles] over the timed steps)", "",
              "| model | context | " + " | ".join(DECODE_KINDS) + " | compressed / DynamicCache: uniform; adaptive |",
              "|---|---|" + "---|" * (len(DECODE_KINDS) + 1)]
    for (model, _), rs in _groups(rows, "decode").items():
        by = {r["cache"]: r for r in rs}
        cells = [f"{by[k]['median_ms']:.1f} [{by[k]['q25_ms']:.1f}, {by[k]['q75_ms']:.1f}]" for k in DECODE_KINDS]
        ratio = "; ".join(f"{by[k]['ratio_to_dynamic']:.2f} [{by[k]['ratio_lo']:.2f}, {by[k]['ratio_hi']:.2f}]"
                          for k in COMPRESSED_KINDS)
        lines.append(f"| {model} | {rs[0]['context_tokens']} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "### Prefill (seconds) and compression (% of the untracked kvmem prefill)", "",
              "DynamicCache runs on the same model object, under kvmem's attention function: its decode steps are "
              "transformers' SDPA, but on Gemma-3 its prefill's sliding-window layers read only their window, as "
              "kvmem's do (stock transformers attends over the whole context under a mask there; timed apart in "
              "`results/race/prefill-timing.jsonl`).", "",
              "| model | context | DynamicCache | kvmem | kvmem tracked | " + " | ".join(
                  f"{m}{' adaptive' if b == 'adaptive' else ''}" for m, b in _compress_columns(rows)) + " |",
              "|---|---|---|---|---|" + "---|" * len(_compress_columns(rows))]
    compress_groups = _groups(rows, "compress")
    for key, rs in _groups(rows, "prefill").items():
        by = {r["cache"]: r["median_s"] for r in rs}
        comp = {(r["method"], r["budget"]): r["fraction_of_prefill"] for r in compress_groups.get(key, [])}
        lines.append(f"| {key[0]} | {rs[0]['context_tokens']} | {by['dynamic']:.2f} | {by['kvmem']:.2f} | "
                     f"{by['kvmem-tracked']:.2f} | "
                     + " | ".join(f"{100 * comp[mb]:.2f}%" if mb in comp else "–" for mb in _compress_columns(rows)) + " |")
    lines += ["", "### Memory (one process per row: load, prefill, decode)", "",
              "| model | context | cache | KV held | peak RSS | RSS after load | peak - after load | ragged layers |",
              "|---|---|---|---|---|---|---|---|"]
    for _, rs in _groups(rows, "memory").items():
        for r in sorted(rs, key=lambda r: DECODE_KINDS.index(r["cache"])):
            extra = (r["peak_rss_bytes"] - r["rss_loaded_bytes"]) if r["peak_rss_bytes"] and r["rss_loaded_bytes"] else None
            lines.append(f"| {r['model']} | {r['context_tokens']} | {r['cache']} | {_mib(r['kv_bytes'])} | "
                         f"{_mib(r['peak_rss_bytes'])} | {_mib(r['rss_loaded_bytes'])} | {_mib(extra)} | {r['ragged_layers']} |")
    return lines


def _malloc_note(rows: list[dict]) -> str:
    values = {r.get("malloc_mmap_threshold") for r in rows if r["measure"] == "memory"}
    if values == {None}:
        return ("glibc's default malloc (freed tensors stay in its heap: two runs of one configuration can peak "
                "100 MiB apart)")
    return (f"malloc's mmap threshold fixed at {', '.join(sorted(map(str, values - {None})))} bytes "
            "(MALLOC_MMAP_THRESHOLD_), so freed tensors go back to the OS and the peak is what was live (with "
            "glibc's default, two runs of one configuration peaked 90-130 MiB apart)")


def _compress_columns(rows: list[dict]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["method"], r["budget"]) for r in rows if r["measure"] == "compress"))


def command(config: dict) -> str:
    """The `kvmem eval` command line of a run (from the config recorded in results.json)."""
    methods = [m for m in METHODS if m != "full"]
    return (f"kvmem eval --suite speed --models {','.join(config['models'])} "
            f"--lengths {','.join(map(str, config['lengths']))}"
            + (f" --methods {','.join(config['methods'])}" if config["methods"] != methods else "")
            + (f" --threads {config['threads']}" if config["threads"] else "") + f" --out {config['out']}")


def report(rows: list[dict], meta: dict, plot: Path | None = None) -> str:
    lines = ["# kvmem speed and memory benchmark", "",
             f"Commit {meta['commit']}{' with uncommitted changes' if meta.get('uncommitted_changes') else ''}, "
             f"{meta['date']}, torch {meta['torch']}, {meta['cpus']} CPUs ({meta['machine']}); "
             f"load average {meta['load_average_start'][0]:.2f} at the start and {meta['load_average_end'][0]:.2f} at "
             f"the end (other work on the machine slows every configuration alike only while it is steady); "
             f"wall time {meta['wall_s'] / 60:.1f} min. Command: `{command(meta['config'])}`; results.json has "
             "every measurement (each step, each repeat, ru_maxrss).", ""]
    lines += speed_section(rows)
    lines += [f"- Not measured: {r['method']} ({r['budget']}) on {r['model']} @ {r['context_tokens']}: {r['reason']}"
              for r in rows if r["measure"] == "skipped"]
    if plot is not None:
        lines += ["", f"![decode ms per token vs context length]({plot.name})"]
    return "\n".join(lines) + "\n"


def plot_decode(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["measure"] == "decode"]
    models = sorted({r["model"] for r in decode})
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for kind in DECODE_KINDS:
            rs = sorted((r for r in decode if r["model"] == model and r["cache"] == kind), key=lambda r: r["context_tokens"])
            x = [r["context_tokens"] for r in rs]
            y = [r["median_ms"] for r in rs]
            err = [[r["median_ms"] - r["q25_ms"] for r in rs], [r["q75_ms"] - r["median_ms"] for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=kind)
        ax.set_title(f"{model}: decode")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per token (median, quartiles)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

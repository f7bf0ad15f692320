"""The reuse benchmark (`kvmem eval --suite reuse`): time to first token with and without stored KV, per tier
and codec, the codecs' bytes and speed, and the quality each lossy codec costs.

Per model and context length (one record per measurement in OUT/records.jsonl, resumable by length):

A prompt of `length` tokens is a document (`length` - 64 tokens) and a question.

* `cold`: a request with nothing stored: one prefill forward of the whole prompt (what kvmem does without a
  store), and the chunked prefill that also encodes and writes every chunk (what the first request costs with
  a store).
* `warm`: the same document with another question, every (tier, codec): the document's stored chunks and its
  partial last chunk (stored under a key of exactly the document, `prefill(context_end=...)`) are read, verified,
  decoded and imported, the question prefilled; TTFT is until the first token's logits, the median of
  `repeats` runs, broken down into read / decode / import / prefill. Disk is read with the OS page cache
  dropped first where the process may (root), so it reads the device (before the clock starts); the record says
  which. Each run is timed twice, alternating: as kvmem loads (layers put in place while the forward runs,
  `reuse/pipeline.py`) and sequentially (`warm-sequential`: every layer in place before the forward); a full
  garbage collection runs before each, untimed (one due fell inside a load at random, ~0.2 s in this process).
  `critical_load_s`: what the load adds to TTFT, TTFT less the forward's own compute (prefill less its waits).
* `semantic`: semantic lookup with token verification against exact chunk reuse (`kvmem_bench/reuse/semantic.py`).
* `semshare`: SemShareKV against token recycling on semantically similar, not token-identical prompt pairs
  (`kvmem_bench/reuse/semantic.py`, `run_similar`), every model.
* `quality`: per codec, Delta-ppl (paired block bootstrap CI) of a held-out continuation fed on top of the
  decoded prefix against the raw one. `tasks` (optional): the long-context suite's samples answered from a
  prefix stored with each codec, scored as the main report scores them.
* `codec-frontier` (not in the default): stored bytes against Delta-ppl for a grid of CacheGen settings and
  kivi-2/4/8, several held-out documents per model (`kvmem_bench/reuse/frontier.py`, issue 36).

The document is the held-out text of the quant benchmark, so nothing here was seen by a calibration.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem_bench.perplexity import ppl_texts, token_nlls
from kvmem_bench.records import read_records
from kvmem.forward import feed
from kvmem.reuse.prefix import prefill
from kvmem.store import ChunkStore
from kvmem.store.tiers import DiskTier, LocalRedis, MemoryTier, RedisTier
from kvmem_bench.records import append_record
from kvmem_bench.reuse.pieces import save_document, stored_pieces

QUESTIONS = ("\n\nQuestion: which methods does the text above propose? Answer:",
             "\n\nQuestion: what problem do the authors of the last paragraph address? Answer:")
DEFAULT_CODECS = ["raw", "quant:kivi-8", "quant:kivi-4", "quant:kivi-2", "cachegen"]
TIERS = ["memory", "disk", "redis"]


PARTS = ("ttft", "tasks", "semantic", "semshare", "codec-frontier")


@dataclass
class ReuseConfig:
    models: list[str]
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    codecs: list[str] = field(default_factory=lambda: list(DEFAULT_CODECS))
    tiers: list[str] = field(default_factory=lambda: list(TIERS))
    chunk_size: int = 256
    repeats: int = 5
    continuation: int = 256
    out: Path = Path("results/reuse")
    threads: int = 1
    parts: tuple[str, ...] = ("ttft", "tasks", "semantic")
    semantic_pairs: int = 20  # pairs of prompts in the semantic-lookup part (kvmem_bench/reuse/semantic.py), first model only
    similar_pairs: int = 24  # pairs of similar prompts in the semshare part, per model
    task_samples: int = 10  # per usable long-context task, answered from a prefix stored with each codec
    task_length: int = 2048
    bench: Path = Path("results/longctx")  # the suite whose usable tasks are used

    def validate(self) -> None:
        from kvmem.store import get_codec

        for c in self.codecs:
            get_codec(c)
        if unknown := set(self.tiers) - set(TIERS):
            raise KVMemError(f"unknown tier(s) {sorted(unknown)}; the benchmark times {', '.join(TIERS)}")
        if unknown := set(self.parts) - set(PARTS):
            raise KVMemError(f"unknown reuse part(s) {sorted(unknown)}; the parts are {', '.join(PARTS)}")
        if "raw" not in self.codecs:
            raise KVMemError("the reuse benchmark needs the raw codec (the reference for every lossy one)")


def _drop_page_cache() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


QUESTION_ROOM = 64  # a prompt of `length` tokens: the document, then up to this many for the question


def _document(lm, length: int) -> tuple[list[int], list[int]]:
    """A document of `length - QUESTION_ROOM` tokens of held-out text (so document and question fit `length`, e.g.
    the model's 8192) and the continuation after it (the quant benchmark's texts)."""
    n = length - QUESTION_ROOM
    ids = ppl_texts(lm.tokenizer, n + 512, 1)[0]
    return ids[:n], ids[n:]


def _raw_read_s(tier, keys: list[str], drop: bool) -> float:
    """The time to read the stored bytes and nothing else (the tier's `get` of every piece, one after another, the
    page cache dropped first for disk where the process may): what a load's read, verify, decode and import are
    measured against."""
    if drop:
        _drop_page_cache()
    t = time.perf_counter()
    for key in keys:
        if tier.get(key) is None:
            raise KVMemError(f"{tier.name}: stored piece {key[:12]} vanished before its raw read")
    return time.perf_counter() - t


def _median(runs: list[tuple[float, object]]) -> tuple[float, object]:
    """The run of median time (the upper median of an even count) and its result."""
    return sorted(runs, key=lambda r: r[0])[len(runs) // 2]


def _median_run(fn, repeats: int) -> tuple[float, object]:
    times, last = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), last


@torch.no_grad()
def run_length(lm, model: str, length: int, cfg: ReuseConfig, redis_url: str | None, log=print) -> None:
    path = cfg.out / "records.jsonl"
    base = dict(model=model, length=length, chunk=cfg.chunk_size, threads=torch.get_num_threads())
    doc, after = _document(lm, length)
    q1, q2 = (lm.tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS)
    first, second = doc + q1, doc + q2
    if max(len(first), len(second)) > min(length, lm.max_context):
        raise KVMemError(f"a {length}-token prompt does not fit {lm.name}'s {lm.max_context} tokens")
    # cold: no store (one forward), then with a store (chunked, encoded, written): the raw chunks come from it
    cold_s, _ = _median_run(lambda: feed(lm, KVCache(lm.model.config), second), 1)
    raw_tier = MemoryTier(max_bytes=2**40)
    raw_store = ChunkStore([raw_tier], "raw", cfg.chunk_size)
    cache = KVCache(lm.model.config)
    t = time.perf_counter()
    _, first_report = prefill(lm, cache, first, raw_store, context_end=len(doc))
    cold_store_s = time.perf_counter() - t
    append_record(path, base | dict(kind="cold", ttft_s=cold_s, with_store_s=cold_store_s, prompt_tokens=len(second),
                              document_tokens=len(doc)))
    log(f"{model} {length}: cold TTFT {cold_s:.2f} s; first request with a store {cold_store_s:.2f} s")
    pieces = stored_pieces(lm, raw_store, doc, first)
    del cache
    with tempfile.TemporaryDirectory(prefix="kvmem-bench-") as tmp:
        for codec in cfg.codecs:
            tiers = {"memory": MemoryTier(max_bytes=2**40)}
            if "disk" in cfg.tiers:
                tiers["disk"] = DiskTier(Path(tmp) / codec.replace(":", "_"))
            if "redis" in cfg.tiers and redis_url:
                tiers["redis"] = RedisTier(redis_url)
            writer = ChunkStore(list(tiers.values()), codec, cfg.chunk_size)
            t = time.perf_counter()
            entries = save_document(lm, writer, doc, first, pieces)
            write_s = time.perf_counter() - t
            nbytes = tiers["memory"].nbytes
            t = time.perf_counter()
            for key, start, n, compression in entries:  # read from memory, verify, decode
                writer.load(lm, key, start, n, compression, exact=True)
            read_decode_s = time.perf_counter() - t
            rec = base | dict(kind="codec", codec=writer.codec.spec, bytes=nbytes, tokens=len(doc),
                              bytes_per_token=nbytes / len(doc), encode_tokens_per_s=len(doc) / write_s,
                              decode_tokens_per_s=len(doc) / read_decode_s, tiers_written=list(tiers))
            append_record(path, rec)
            log(f"  {writer.codec.spec}: {rec['bytes_per_token']:.0f} B/token, encode+write {rec['encode_tokens_per_s']:.0f} "
                f"tok/s, decode {rec['decode_tokens_per_s']:.0f} tok/s")
            for name, tier in tiers.items():
                store = ChunkStore([tier], codec, cfg.chunk_size)
                # the product's load (layers put in place while the forward runs) and the sequential one (every layer
                # in place before the forward starts), interleaved so that both see the same machine; the page cache
                # is dropped (disk) and a due garbage collection run before the clock starts
                runs = {True: [], False: []}
                dropped = False
                for _ in range(cfg.repeats):
                    for overlap in (False, True):
                        if name == "disk":
                            dropped = _drop_page_cache()
                        gc.collect()  # a full collection (~0.2 s in this process) fell inside one mode's run at random
                        t = time.perf_counter()
                        report = prefill(lm, KVCache(lm.model.config), second, store, context_end=len(doc),
                                         overlap=overlap)[1]
                        runs[overlap].append((time.perf_counter() - t, report))
                (ttft, report), (seq_ttft, seq_report) = (_median(runs[True]), _median(runs[False]))
                raw_read_s = _raw_read_s(tier, [e[0] for e in entries], name == "disk")
                if report.reused_tokens != len(doc) or seq_report.reused_tokens != len(doc):
                    raise KVMemError(f"{name}/{codec}: reused {report.reused_tokens} tokens, expected {len(doc)}")
                for kind, t, r in (("warm", ttft, report), ("warm-sequential", seq_ttft, seq_report)):
                    append_record(path, base | dict(kind=kind, tier=name, codec=writer.codec.spec, ttft_s=t,
                                                    cold_ttft_s=cold_s, speedup=cold_s / t, read_s=r.read_s,
                                                    decode_s=r.decode_s, import_s=r.import_s, wait_s=r.wait_s,
                                                    # what the load adds to TTFT: all but the forward's own compute
                                                    critical_load_s=t - (r.prefill_s - r.wait_s),
                                                    prefill_s=r.prefill_s, reused_tokens=r.reused_tokens,
                                                    computed_tokens=r.computed_tokens, raw_read_s=raw_read_s,
                                                    page_cache_dropped=dropped if name == "disk" else None))
                log(f"    {name}: TTFT {ttft:.3f} s ({cold_s / ttft:.1f}x; sequential {seq_ttft:.3f} s) read "
                    f"{report.read_s:.3f} decode {report.decode_s:.3f} import {report.import_s:.3f} prefill "
                    f"{report.prefill_s:.3f} (waited {report.wait_s:.3f})")
            # quality: a held-out continuation on top of the decoded prefix
            cache = KVCache(lm.model.config)
            prefill(lm, cache, doc + after[:1], ChunkStore([tiers["memory"]], codec, cfg.chunk_size), context_end=len(doc))
            nll = token_nlls(lm, cache, after[1:cfg.continuation + 2], 64)
            append_record(path, base | dict(kind="nll", codec=writer.codec.spec, nll=nll))
            del cache


@torch.no_grad()
def run_codec_tasks(lm, model: str, cfg: ReuseConfig, log=print) -> None:
    """The long-context suite's usable tasks answered from the context's chunks stored with each codec (the
    context prefilled once; each codec encodes its chunks, and the answer loads them and prefills the rest)."""
    from kvmem_bench.longctx.race import usable_swept_tasks
    from kvmem_bench.longctx.tasks import make_samples, score
    from kvmem.generate import decode
    from kvmem.prompts import build_prompt

    path = cfg.out / "records.jsonl"
    tasks = usable_swept_tasks(cfg.bench / "records.jsonl").get((model, cfg.task_length), [])
    if not tasks:
        log(f"tasks {model} @ {cfg.task_length}: no usable task in {cfg.bench} (run the long-context suite first)")
        return
    done = {(r["task"], r["sample"], r["codec"]) for r in read_records(path) if r["kind"] == "task" and r["model"] == model}
    for task in tasks:
        for i, sample in enumerate(make_samples(task, lm.tokenizer, cfg.task_length, cfg.task_samples)):
            specs = {c: ChunkStore([MemoryTier(max_bytes=2**40)], c, cfg.chunk_size) for c in cfg.codecs}
            if all((task, i, s.codec.spec) in done for s in specs.values()):
                continue
            t0 = time.perf_counter()
            prompt = build_prompt(lm.tokenizer, sample.context, sample.question, sample.answer_prefix)
            raw = ChunkStore([MemoryTier(max_bytes=2**40)], "raw", cfg.chunk_size)
            prefill(lm, KVCache(lm.model.config), prompt.context, raw, context_end=len(prompt.context))
            pieces = stored_pieces(lm, raw, prompt.context, prompt.context)  # the pieces a store's first request computes
            for codec, store in specs.items():
                save_document(lm, store, prompt.context, prompt.ids, pieces)
                answer_cache = KVCache(lm.model.config)
                logits, report = prefill(lm, answer_cache, prompt.ids, store, context_end=len(prompt.context))
                tokens = decode(lm, answer_cache, logits, sample.max_new_tokens, stop_at_newline=sample.one_line,
                                answers=sample.answers)
                text = lm.tokenizer.decode(tokens)
                append_record(path, dict(kind="task", model=model, length=cfg.task_length, task=task, sample=i,
                                   codec=store.codec.spec, score=score(sample, text), output=text,
                                   reused_tokens=report.reused_tokens, threads=torch.get_num_threads()))
            log(f"tasks {model} {task} #{i}: {len(specs)} codecs in {time.perf_counter() - t0:.0f} s")


def run_reuse(cfg: ReuseConfig, log=print) -> Path:
    from kvmem.models import load_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.out.mkdir(parents=True, exist_ok=True)
    records = read_records(cfg.out / "records.jsonl")
    # a length is done when every codec has its quality and its sequential-load comparison (runs from before the
    # layer-wise pipelining lack the latter and are measured again)
    done = {(m, n) for m in cfg.models for n in cfg.lengths
            if all(len({r["codec"] for r in records if r["kind"] == kind and r["model"] == m and r["length"] == n})
                   >= len(cfg.codecs) for kind in ("nll", "warm-sequential"))}
    server = LocalRedis().start() if "redis" in cfg.tiers and "ttft" in cfg.parts else None
    try:
        for model in cfg.models:
            lm = load_model(model)
            for length in cfg.lengths if "ttft" in cfg.parts else []:
                if (model, length) in done:
                    log(f"{model} {length}: done (records kept)")
                    continue
                run_length(lm, model, length, cfg, server.url if server else None, log)
            if "tasks" in cfg.parts:
                run_codec_tasks(lm, model, cfg, log)
            if "semantic" in cfg.parts and model == cfg.models[0] and not (cfg.out / "semantic_summary.json").exists():
                from kvmem_bench.reuse.semantic import run_semantic

                run_semantic(lm, n=cfg.semantic_pairs, out=cfg.out, chunk_size=cfg.chunk_size,
                             threads=cfg.threads or torch.get_num_threads())
            if "semshare" in cfg.parts and not (cfg.out / f"semshare-{lm.name}.json").exists():
                from kvmem_bench.reuse.semantic import run_similar

                run_similar(lm, n=cfg.similar_pairs, out=cfg.out, chunk_size=cfg.chunk_size,
                            threads=cfg.threads or torch.get_num_threads(), log=log)
            if "codec-frontier" in cfg.parts:
                from kvmem_bench.reuse.frontier import run_frontier

                run_frontier(lm, model, cfg.out, chunk_size=cfg.chunk_size, log=log)
    finally:
        if server is not None:
            server.kill()
    from kvmem_bench.reuse.report import write_report

    return write_report(cfg.out)

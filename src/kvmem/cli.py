"""The `kvmem` command line: demo, generate, eval, race, embed, serve, methods, models."""

from __future__ import annotations

import functools
import os
import warnings
import sys
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kvmem.errors import KVMemError

app = typer.Typer(
    help="kvmem: make the KV cache of transformer LLMs small, reusable and useful.\n\n"
    "Start with `kvmem demo`. Compression strength is always the keep ratio: the fraction of the KV cache kept.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()


@app.callback()
def _quiet() -> None:
    """Keep the terminal for kvmem's own output: no weight-loading progress bars from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # kvmem's own warnings (a store tier down, a chunk discarded) as one plain line each
    warnings.showwarning = lambda message, category, *_: console.print(f"[yellow]warning:[/yellow] {message}", highlight=False,
                                                                       soft_wrap=True)


def clean_errors(fn):
    """Bad input ends in one line naming the problem, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (KVMemError, FileNotFoundError, IsADirectoryError) as e:
            console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except UnicodeDecodeError:
            console.print("[red]error:[/red] an input file is not UTF-8 text", highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper


def _csv(value: str, kind=str) -> list:
    try:
        return [kind(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise KVMemError(f"cannot read {value!r} as a comma-separated list of {kind.__name__}") from None


def _check_cache_options(method: str, keep_ratio: float, quant: str | None) -> None:
    """The compression method, keep ratio and quantization scheme, checked before a model loads."""
    from kvmem.compress import get_method
    from kvmem.compress.evict import check_keep_ratio
    from kvmem.quant import get_scheme

    m = get_method(method)
    if quant:
        get_scheme(quant)
    check_keep_ratio(keep_ratio, 1)
    if m.name == "full" and keep_ratio < 1.0:
        raise KVMemError("method 'full' keeps every token; use --keep-ratio 1.0 or another method")


@app.command()
@clean_errors
def demo(
    model: str = typer.Option("smollm2-135m", help="Registry name, local folder or HF id."),
    keep_ratio: float = typer.Option(0.25, help="Fraction of the KV cache each method keeps."),
    length: int = typer.Option(1500, help="Document length in tokens."),
) -> None:
    """The main job: the model reads a long document and answers questions with the full cache and with
    several compression methods side by side, compressed before (agnostic) and after (aware) the question."""
    from kvmem.eval.longctx import run_sample
    from kvmem.eval.tasks import make_samples
    from kvmem.models import load_model

    methods = ["full", "kvzip", "expected-attention", "keydiff", "streaming-llm", "h2o", "snapkv", "tova", "knorm", "random"]
    lm = load_model(model)
    console.print(f"model [bold]{lm.name}[/bold] (fingerprint {lm.fingerprint}), keep ratio {keep_ratio}")
    for task in ("fact-single", "niah-single-number"):
        sample = make_samples(task, lm.tokenizer, length, 1, seed=7)[0]
        console.rule(f"{task}: {length}-token document")
        console.print(f"question: {sample.question.strip()} → {sample.answer_prefix.strip()} …   "
                      f"[dim](expected: {', '.join(sample.answers)})[/dim]")
        with console.status("prefill once, then every method on a copy of the cache, answered in one batch ..."):
            records = run_sample(lm, sample, methods, [keep_ratio])
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        for col, width in (("setting", 8), ("method", 13), ("KV MiB", 6), ("kept", 4), ("answer", 0), ("correct", 7), ("compress", 8)):
            table.add_column(col, no_wrap=True, min_width=width or None, max_width=width or 20, overflow="ellipsis")
        for r in records:
            table.add_row(r["setting"], r["method"], f"{r['kv_bytes'] / 2**20:.1f}",
                          f"{r['kv_bytes'] / r['kv_bytes_full']:.2f}", " ".join(r["output"].split())[:32],
                          "[green]yes[/green]" if r["score"] == 1 else ("[yellow]part[/yellow]" if r["score"] else "[red]no[/red]"),
                          f"{r['compress_s'] * 1000:.0f} ms")
        console.print(table)


@app.command()
@clean_errors
def generate(
    prompt: str = typer.Option(..., help="The question or instruction, fed after the context."),
    context_file: Optional[Path] = typer.Option(None, help="A text file read (and compressed) before the prompt."),
    model: str = typer.Option("smollm2-135m", help="Registry name, local folder or HF id."),
    method: str = typer.Option("snapkv", help="Compression method or spec, e.g. kvzip, snapkv:window=64:budget=adaptive (see `kvmem methods`)."),
    keep_ratio: float = typer.Option(0.5, help="Fraction of the context's KV cache kept, in (0, 1]."),
    query_aware: bool = typer.Option(False, help="Compress after reading the prompt too (not reusable across prompts)."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate (stops at end of line)."),
    raw_prompt: bool = typer.Option(False, help="No chat template: the context and prompt as plain text (base models)."),
    quant: Optional[str] = typer.Option(None, help="Hold the cache quantized, e.g. kivi-2, kivi-4:group=64 (after eviction)."),
    store: Optional[str] = typer.Option(None, help="Keep and reuse computed KV: tiers fastest first, e.g. "
                                        "memory,disk:///tmp/kvmem,redis://127.0.0.1:6379/0."),
    codec: str = typer.Option("raw", help="How the store encodes chunks: raw, quant:<scheme> (e.g. quant:kivi-8), cachegen."),
    chunk_size: int = typer.Option(256, help="Tokens per stored chunk."),
    store_write: str = typer.Option("through", help="Store writes: through (every tier) or memory (the first tier only)."),
) -> None:
    """Read a context, compress its KV cache, answer the prompt; prints the answer and the memory held. With
    --store, computed KV is kept and a later run on the same context reuses it (and says how much)."""
    from kvmem.generate import answer
    from kvmem.models import load_model

    _check_cache_options(method, keep_ratio, quant)  # fail on a bad option before loading anything
    chunks = None
    if store:
        from kvmem.store import ChunkStore

        chunks = ChunkStore(store, codec, chunk_size, store_write)  # a bad tier, codec or size fails before the model loads
    context = context_file.read_text() if context_file else ""
    lm = load_model(model)
    a = answer(lm, context, prompt, method, keep_ratio, query_aware, max_new_tokens, raw_prompt=raw_prompt, quant=quant,
               store=chunks)
    console.print(a.text.strip(), highlight=False)
    if a.reuse is not None:
        console.print(f"[dim]store {', '.join(t.name for t in chunks.tiers)} ({chunks.codec.spec}): {a.reuse.summary()}[/dim]",
                      highlight=False)
    console.print(f"[dim]KV held {a.kv_bytes / 2**20:.2f} MiB of {a.kv_bytes_full / 2**20:.2f} MiB "
                  f"({a.kv_bytes / max(a.kv_bytes_full, 1):.2f}), method {method}"
                  f"{f', quantized {quant}' if quant else ''}[/dim]", highlight=False)


RATIOS_DEFAULT = "1.0,0.5,0.25,0.1"


@app.command("eval")
@clean_errors
def eval_(
    suite: str = typer.Option("longctx", help="longctx (RULER-style tasks, QA, perplexity), retrieval (embeddings), speed (time and memory), quant (quantization: Δppl, decode, tasks), reuse (TTFT from stored KV, codecs, semantic lookup), rag (documents reused at new positions: cacheblend, infoflow), serve (kvmem serve under load: store on / off, two replicas on one Redis, a soak with Redis restarted) or batching (continuous batching: throughput against concurrency beside transformers serve, and the memory-bound case)."),
    models: str = typer.Option("smollm2-135m", help="Comma-separated models."),
    lengths: str = typer.Option("4096", help="Comma-separated context lengths in tokens."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: all of the suite's)."),
    ratios: str = typer.Option(RATIOS_DEFAULT, help="Comma-separated keep ratios (rag: recompute ratios, default 0.15)."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks (retrieval: sets) (default: all)."),
    samples: int = typer.Option(3, help="Samples per task and length."),
    seed: int = typer.Option(0, help="Seed of the generated samples."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default results/SUITE): results.json, report.md, plots."),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default). Two 1-thread runs can beat one 2-thread run."),
    layers: str = typer.Option("-1", help="retrieval: comma-separated hidden layers for the LLM embedders (-1 = last), or 'all'."),
    limit: Optional[int] = typer.Option(None, help="retrieval: only the first N queries (for a quick run)."),
    raw_prompt: bool = typer.Option(False, help="longctx: no chat template, plain text prompts (base models)."),
    quant: Optional[str] = typer.Option(None, help="quant: comma-separated schemes (kvmem's and hf-* baselines; default: all)."),
    cross: Optional[str] = typer.Option(None, help="quant: comma-separated schemes crossed with the eviction methods in the tasks part (default: all of --quant but HF's and 8-bit)."),
    parts: str = typer.Option("ppl,decode,tasks", help="quant: which parts to run (ppl, decode, tasks); reuse: ttft, tasks, semantic; serve: store_on, store_off, soak, replicas; batching: sweep, memory, steps (default all)."),
    texts: int = typer.Option(2, help="quant: held-out perplexity texts per model (each --lengths tokens)."),
    codecs: Optional[str] = typer.Option(None, help="reuse: comma-separated store codecs (default: raw, quant:kivi-8/4/2, cachegen)."),
    clients: int = typer.Option(4, help="serve: concurrent clients."),
    duration: float = typer.Option(120, help="serve: seconds of load with the store on, then off."),
    soak: float = typer.Option(180, help="serve: seconds of the soak (Redis killed a third of the way in, restarted; 0: none)."),
    workers: int = typer.Option(1, help="serve: the servers' --workers (--threads is their torch threads)."),
    concurrency: str = typer.Option("1,2,4,8,16,32", help="batching: comma-separated client concurrencies of the sweep."),
    servers: Optional[str] = typer.Option(None, help="batching: kvmem-single, kvmem-batching, transformers (default all)."),
    kv_budget: str = typer.Option("256MiB", help="batching: the memory phase's --kv-budget."),
    memory_duration: float = typer.Option(180, help="batching: seconds of each of a memory-phase configuration's segments under load (the committed run: 60)."),
    sweep_rounds: int = typer.Option(1, help="batching: rounds of each sweep concurrency (every server runs one --duration segment a round, the order reversed every other round; ratios pair the rounds)."),
    memory_rounds: int = typer.Option(3, help="batching: rounds of the memory phase (each runs every configuration for one segment, the order reversed every other round)."),
) -> None:
    """Run a benchmark. longctx: compression methods on long-context tasks (resumes from OUT/records.jsonl).
    retrieval: embedding methods on the offline retrieval sets (abstracts, questions).
    speed: prefill / compression / decode time and peak memory per cache kind (--methods: methods to time)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if suite == "retrieval":
        from kvmem.embed import EMBEDDERS
        from kvmem.eval.retrieval import SETS, run_retrieval

        out = out or Path("results/retrieval")
        run_retrieval(_csv(models), _csv(methods) if methods else list(EMBEDDERS), _csv(tasks) if tasks else list(SETS),
                      out, layers="all" if layers == "all" else _csv(layers, int), limit=limit)
        console.print(f"wrote {out / 'results.json'} and {out / 'report.md'}")
        return
    if suite == "speed":
        from kvmem.eval.speed import SpeedConfig, run_speed

        cfg = SpeedConfig(models=_csv(models), lengths=_csv(lengths, int), threads=threads,
                          out=out or Path("results/speed"), **({"methods": _csv(methods)} if methods else {}))
        path = run_speed(cfg)
        console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")
        return
    if suite == "rag":
        from kvmem.eval.rag import run_rag

        path = run_rag(_csv(models), _csv(methods) if methods else ("full", "none", "cacheblend", "infoflow"), samples,
                       _csv(ratios, float) if ratios != RATIOS_DEFAULT else [0.15], out or Path("results/rag"), seed)
        console.print(f"report: {path / 'report.md'}")
        return
    if suite == "reuse":
        from kvmem.eval.reuse import DEFAULT_CODECS, ReuseConfig, run_reuse

        chosen = [p for p in _csv(parts) if p in ("ttft", "tasks", "semantic")]
        cfg = ReuseConfig(models=_csv(models), lengths=_csv(lengths, int), codecs=_csv(codecs) if codecs else list(DEFAULT_CODECS),
                          out=out or Path("results/reuse"), threads=threads, task_samples=samples,
                          parts=tuple(chosen or ("ttft", "tasks", "semantic")))
        path = run_reuse(cfg, log=console.print)
        console.print(f"report: {path}")
        return
    if suite == "serve":
        import shlex

        from kvmem.eval.load import PHASES, run_load_suite

        chosen = tuple(p for p in _csv(parts) if p in PHASES) or PHASES
        report = run_load_suite(out or Path("results/serve"), _csv(models)[0], clients, duration, soak,
                                threads=threads or 1, workers=workers, phases=chosen, log=console.print,
                                command=shlex.join(["kvmem", *sys.argv[1:]]))
        console.print(f"report: {report}")
        return
    if suite == "batching":
        import shlex

        from kvmem.eval.batching import MEMORY_CONFIGS, SERVERS, run_batching_suite

        report = run_batching_suite(out or Path("results/batching"), _csv(models)[0], tuple(_csv(lengths, int)),
                                    tuple(_csv(concurrency, int)), duration, max_tokens=128, threads=threads or 2,
                                    servers=tuple(_csv(servers)) if servers else SERVERS, memory_budget=kv_budget,
                                    memory_duration_s=memory_duration, memory_rounds=memory_rounds, sweep_rounds=sweep_rounds,
                                    memory_configs=tuple(_csv(methods)) if methods else tuple(MEMORY_CONFIGS),
                                    phases=tuple(p for p in _csv(parts) if p in ("sweep", "memory", "steps")) or ("sweep", "memory", "steps"),
                                    command=shlex.join(["kvmem", *sys.argv[1:]]), log=console.print)
        console.print(f"report: {report}")
        return
    if suite == "quant":
        from kvmem.eval.quant import QuantConfig, default_schemes, run_quant

        length = _csv(lengths, int)[0]
        cfg = QuantConfig(models=_csv(models), schemes=_csv(quant) if quant else default_schemes(), parts=_csv(parts),
                          length=length, texts=texts, decode_length=length, task_length=length, task_samples=samples,
                          task_ratios=_csv(ratios, float), out=out or Path("results/quant"),
                          **({"task_methods": _csv(methods)} if methods else {}),
                          **({"task_schemes": _csv(cross)} if cross else {}))
        path = run_quant(cfg, log=console.print)
        console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")
        return
    out = out or Path("results/longctx")
    from kvmem.compress import METHODS
    from kvmem.eval.longctx import ALL_TASKS, EvalConfig, run

    if suite != "longctx":
        raise KVMemError(f"unknown suite {suite!r}; available: longctx, retrieval, speed, quant, reuse, rag, serve, batching")
    cfg = EvalConfig(
        models=_csv(models), lengths=_csv(lengths, int),
        tasks=_csv(tasks) if tasks else list(ALL_TASKS),
        methods=_csv(methods) if methods else list(METHODS),
        ratios=_csv(ratios, float), samples=samples, seed=seed, out=out, raw_prompt=raw_prompt,
    )
    path = run(cfg)
    console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")


@app.command()
@clean_errors
def race(
    models: Optional[str] = typer.Option(None, help="Comma-separated models (default: every model the suite ran)."),
    lengths: Optional[str] = typer.Option(None, help="Comma-separated context lengths (default: all the suite ran)."),
    bench: Path = typer.Option(Path("results/longctx"), help="The long-context suite's folder: its swept tasks are raced."),
    out: Path = typer.Option(Path("results/race"), help="Where kvpress's records, logs and runs go."),
    venv: Path = typer.Option(Path(".venv-race"), help="kvpress's own virtualenv (make race-setup)."),
    samples: int = typer.Option(30, help="Samples per task (the suite's count)."),
    threads: int = typer.Option(1, help="torch threads per runner process (one process per model)."),
    check: int = typer.Option(0, help="Instead: compare kvpress's own pipeline with the harness on N samples a model."),
    presses: Optional[str] = typer.Option(None, help="Comma-separated kvpress presses to run (default: all)."),
    first: Optional[int] = typer.Option(None, help="Run them on the first N samples of each task only (default: "
                                                   "all; kvzip and observed-attention named in --presses: 10)."),
    settings: str = typer.Option("agnostic", help="Comma-separated settings, agnostic and/or aware (aware: the "
                                                  "question is compressed with the context, as kvpress's query-aware "
                                                  "evaluation does)."),
) -> None:
    """Race kvpress on the suite's prompts: its presses run in their own virtualenv on the same token ids, and
    their answers are scored like kvmem's. Resumable; rebuilds the suite's report with the race in it."""
    from kvmem.eval.race import race as run_race

    path = run_race(bench, out, venv, _csv(models) if models else None, _csv(lengths, int) if lengths else None,
                    samples, threads, check, _csv(presses) if presses else None, first, tuple(_csv(settings)))
    console.print(f"wrote {path}")


@app.command()
@clean_errors
def embed(
    files: Optional[list[Path]] = typer.Argument(None, help="Text files, one text per line (default: stdin)."),
    out: Path = typer.Option(..., help="Where to write: .npy (the matrix) or .jsonl (one {text, embedding} per line)."),
    method: str = typer.Option("prompteol", help="mean, last, prompteol, echo, token-prepending, kv-embedding (from the "
                                                 "LLM), minilm, tfidf; options as in kv-embedding:layers=8-14:bias=1."),
    model: str = typer.Option("smollm2-135m", help="The LLM the LLM methods embed with."),
    layer: int = typer.Option(-1, help="Hidden layer for the LLM methods (-1 = last)."),
    precision: str = typer.Option("float32", help="float32, int8 or binary (packed sign bits)."),
    normalize: bool = typer.Option(True, help="L2-normalise float embeddings."),
    batch_size: int = typer.Option(8, help="Texts per forward pass."),
) -> None:
    """Embed texts with a training-free method (see `kvmem eval --suite retrieval` for how each does)."""
    import json

    import numpy as np

    from kvmem.embed import get_embedder, is_lm_method, parse_method

    if out.suffix not in (".npy", ".jsonl"):
        raise KVMemError(f"--out must end in .npy or .jsonl; got {out.name!r}")
    texts = [line.strip() for f in files for line in f.read_text().splitlines()] if files else \
        [line.strip() for line in sys.stdin]
    texts = [t for t in texts if t]
    if not texts:
        raise KVMemError("no text to embed (empty input)")
    parse_method(method)  # a bad method or option fails before the model loads
    embedder = get_embedder(method, model=model if is_lm_method(method) else None, layer=layer)
    embedder.fit(texts)
    vectors = embedder.encode(texts, batch_size=batch_size, normalize_embeddings=normalize, precision=precision,
                              show_progress_bar=True)
    if out.suffix == ".npy":
        np.save(out, vectors)
    else:
        with out.open("w") as f:
            for t, v in zip(texts, vectors):
                f.write(json.dumps({"text": t, "embedding": v.tolist()}) + "\n")
    console.print(f"wrote {len(texts)} embeddings of shape {vectors.shape[1:]} ({vectors.dtype}) to {out}")


@app.command("methods")
def methods_() -> None:
    """List the compression and embedding methods, the papers they follow, and the embedders' options."""
    import inspect

    from kvmem.compress import BUDGETS, METHODS
    from kvmem.embed import EMBEDDERS

    def options(cls, skip=("self", "model", "tokenizer", "layer")) -> list[str]:
        return [f"{p.name}={p.default!r}" for p in inspect.signature(cls.__init__).parameters.values()
                if p.name not in skip and p.default is not p.empty]

    console.print("[bold underline]compression[/bold underline] (kvmem generate/eval --method NAME[:option=value...])")
    console.print(f"every method also takes budget= one of {', '.join(BUDGETS)} (see kvmem/compress/budget.py), and "
                  "sliding=keep (leave sliding-window layers whole) or sliding=compress (the default)")
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        opts = options(cls) + ([f"budget={cls.budget!r}"] if cls.budget != "uniform" else [])
        console.print(f"[bold]{name}[/bold]: {' '.join(doc[:3])}" + (f"  options: {', '.join(opts)}" if opts else ""),
                      highlight=False)
    from kvmem.quant import SCHEMES

    console.print("\n[bold underline]quantization[/bold underline] (kvmem generate --quant NAME[:option=value...])")
    for name, (cls, fixed) in SCHEMES.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        opts = [o for o in options(cls) if o.split("=")[0] not in fixed]
        console.print(f"[bold]{name}[/bold]: {doc[0] if doc else ''}  options: {', '.join(opts)}", highlight=False)
    console.print("\n[bold underline]embedding[/bold underline] (kvmem embed --method NAME[:option=value...])")
    for name, cls in EMBEDDERS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        opts = options(cls)
        console.print(f"[bold]{name}[/bold]: {doc[0] if doc else ''}" + (f"  options: {', '.join(opts)}" if opts else ""),
                      highlight=False)


@app.command()
@clean_errors
def serve(
    model: str = typer.Option("smollm2-135m", help="Registry name, local folder or HF id (loaded once, shared by all requests)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    store: Optional[str] = typer.Option(None, help="Keep and reuse computed KV across requests (and replicas, through "
                                        "Redis): tiers fastest first, e.g. memory,disk:///tmp/kvmem,redis://127.0.0.1:6379/0."),
    codec: str = typer.Option("raw", help="How the store encodes chunks: raw, quant:<scheme>, cachegen."),
    chunk_size: int = typer.Option(256, help="Tokens per stored chunk."),
    store_write: str = typer.Option("through", help="Store writes: through (every tier) or memory (the first tier only)."),
    method: str = typer.Option("full", help="Default compression method (a request's kvmem.method overrides it)."),
    keep_ratio: float = typer.Option(1.0, help="Default fraction of the context's KV kept, in (0, 1]."),
    quant: Optional[str] = typer.Option(None, help="Default quantization scheme of the cache, e.g. kivi-4."),
    batching: bool = typer.Option(True, help="Continuous batching: every running request decodes in one batch, admitted "
                                  "by KV bytes (--kv-budget). --no-batching: --workers threads, one request each."),
    kv_budget: str = typer.Option("0.25", help="With batching: KV bytes the running requests may hold, e.g. 512MiB, or a "
                                  "fraction of the machine's memory (0.25). Past it, requests wait and rows are preempted."),
    max_batch: int = typer.Option(64, help="With batching: most sequences decoded together."),
    workers: int = typer.Option(1, help="With --no-batching: requests computed at once (each in its own thread)."),
    queue: int = typer.Option(16, help="Requests that may wait (for a worker, or for KV memory); more get 429 with Retry-After."),
    threads: int = typer.Option(0, help="torch CPU threads in all (0: all cores)."),
    timeout: float = typer.Option(120.0, help="Seconds a request may take, queueing included (a request's kvmem.timeout overrides it)."),
    max_tokens: int = typer.Option(256, help="Completion tokens when a chat request gives no max_tokens."),
    max_n: int = typer.Option(4, help="Most choices (n) per request."),
    embed_method: str = typer.Option("prompteol", help="Embedding method for /v1/embeddings with the model's name (kvmem.embed spec)."),
    log_level: str = typer.Option("info", help="uvicorn's log level."),
) -> None:
    """An OpenAI-compatible HTTP server (chat and text completions, streaming, embeddings, /metrics) with the
    cache layer inside: per-request compression and quantization, KV reused from the store."""
    import torch
    import uvicorn

    from kvmem.embed import parse_method
    from kvmem.models import load_model
    from kvmem.serve.app import create_app
    from kvmem.serve.engine import Options

    _check_cache_options(method, keep_ratio, quant)
    parse_method(embed_method)
    chunks = None
    if store:
        from kvmem.store import ChunkStore

        chunks = ChunkStore(store, codec, chunk_size, store_write)
    if threads:
        torch.set_num_threads(threads)
    budget = _kv_budget(kv_budget) if batching else None
    if max_batch < 1 or queue < 0:
        raise KVMemError(f"--max-batch must be >= 1 and --queue >= 0 (got {max_batch}, {queue})")
    lm = load_model(model)
    app_ = create_app(lm, chunks, Options(method=method, keep_ratio=keep_ratio, quant=quant), workers, queue, timeout,
                      max_tokens, max_n, embed_method, budget, max_batch)
    how = f"continuous batching, KV budget {budget / 2**20:.0f} MiB" if batching else f"{workers} worker(s)"
    console.print(f"kvmem serve: {lm.name} on http://{host}:{port}/v1 (store: {chunks or 'none'}; {how}, "
                  f"queue {queue}, {torch.get_num_threads()} torch threads)", highlight=False)
    uvicorn.run(app_, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _kv_budget(text: str) -> int:
    """`--kv-budget`: a size (512MiB) or a fraction of the machine's memory (0.25)."""
    from kvmem.store.tiers import parse_bytes

    try:
        fraction = float(text)
    except ValueError:
        size = parse_bytes(text)
        if size <= 0:
            raise KVMemError(f"--kv-budget {text}: the budget must be more than 0 bytes") from None
        return size
    if not 0 < fraction <= 1:
        raise KVMemError(f"--kv-budget {text}: a fraction of memory must be in (0, 1], or give a size such as 512MiB")
    return int(fraction * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@app.command("models")
def models_() -> None:
    """List the embedded models (any HF id or local folder works too)."""
    from kvmem.models import REGISTRY

    for name, entry in REGISTRY.items():
        console.print(f"[bold]{name}[/bold]: {entry.description}", highlight=False)


if __name__ == "__main__":
    app()

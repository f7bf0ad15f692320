"""The benchmark's commands, added to `kvmem` as a plugin (entry point `kvmem.cli`): demo (the main job), eval (every
suite) and race (kvpress on the suite's prompts). The product does not import this package."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.table import Table

from kvmem.cli import _csv, clean_errors, console
from kvmem.errors import KVMemError


def register(app: typer.Typer) -> None:
    app.command()(demo)
    app.command("eval")(eval_)
    app.command()(race)


@clean_errors
def demo(
    model: str = typer.Option("smollm2-135m", help="Registry name, local folder or HF id."),
    keep_ratio: float = typer.Option(0.25, help="Fraction of the KV cache each method keeps."),
    length: int = typer.Option(1500, help="Document length in tokens."),
) -> None:
    """The main job: the model reads a long document and answers questions with the full cache and with
    several compression methods side by side, compressed before (agnostic) and after (aware) the question."""
    from kvmem_bench.longctx.runner import run_sample
    from kvmem_bench.longctx.tasks import make_samples
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


RATIOS_DEFAULT = "1.0,0.5,0.25,0.1"
PARTS_DEFAULT = "ppl,decode,tasks"


@clean_errors
def eval_(
    suite: str = typer.Option("longctx", help="longctx (RULER-style tasks, QA, perplexity), retrieval (embeddings), speed (time and memory), quant (quantization: Δppl, decode, tasks), reuse (TTFT from stored KV, codecs, semantic lookup), rag (documents reused at new positions: cacheblend, infoflow), serve (kvmem serve under load: store on / off, two replicas on one Redis and on a Redis Cluster, a soak with Redis restarted and one with a cluster node restarted), batching (continuous batching: throughput against concurrency beside transformers serve, and the memory-bound case), longgen (decode-phase compression on long outputs: a 280-token copy task and streaming perplexity) or kvdirect (KV-Direct's residual checkpoints against the full cache and eviction at the same bytes: token match, bytes held, step time)."),
    models: str = typer.Option("smollm2-135m", help="Comma-separated models."),
    lengths: str = typer.Option("4096", help="Comma-separated context lengths in tokens."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: all of the suite's; kvdirect: the eviction baselines)."),
    ratios: str = typer.Option(RATIOS_DEFAULT, help="Comma-separated keep ratios (rag: recompute ratios, default 0.15)."),
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks (retrieval: sets) (default: all)."),
    samples: int = typer.Option(3, help="Samples per task and length."),
    first_sample: int = typer.Option(0, help="longctx: start at this sample (--first-sample 15 --samples 30 runs samples 15-29), so that two 1-thread processes can split one task; screening then reads the first samples recorded."),
    seed: int = typer.Option(0, help="Seed of the generated samples."),
    out: Optional[Path] = typer.Option(None, help="Output folder (default results/SUITE): results.json, report.md, plots."),
    threads: int = typer.Option(0, help="torch CPU threads (0: torch's default). Two 1-thread runs can beat one 2-thread run."),
    layers: str = typer.Option("-1", help="retrieval: comma-separated hidden layers for the LLM embedders (-1 = last), or 'all'."),
    limit: Optional[int] = typer.Option(None, help="retrieval: only the first N queries (for a quick run)."),
    raw_prompt: bool = typer.Option(False, help="longctx: no chat template, plain text prompts (base models)."),
    eval_settings: Optional[str] = typer.Option(None, "--settings", help="longctx: comma-separated settings, agnostic and/or aware (the latter doubles a sample's cost; default both); quant: the tasks part's (default agnostic)."),
    quant: Optional[str] = typer.Option(None, help="quant: comma-separated schemes (kvmem's and hf-* baselines; default: all)."),
    cross: Optional[str] = typer.Option(None, help="quant: comma-separated schemes crossed with the eviction methods in the tasks part (default: all of --quant but HF's and 8-bit)."),
    parts: str = typer.Option(PARTS_DEFAULT, help="quant: which parts to run (ppl, decode, tasks); longgen: copy, ppl; reuse: ttft, tasks, semantic, semshare (SemShareKV vs token recycling; not in the default), codec-frontier (bytes vs Δppl of CacheGen settings; not in the default); serve: store_on, store_off, soak, replicas, batching, cluster_replicas, cluster_soak; batching: sweep, memory, steps; kvdirect: decode, growth (default all)."),
    texts: int = typer.Option(2, help="quant: held-out perplexity texts per model (each --lengths tokens); longgen: streaming perplexity texts."),
    every: int = typer.Option(1, help="longgen: decoded tokens between re-compressions (Compressor's every=N)."),
    extra_rows: int = typer.Option(64, help="longgen: rows a head may hold beyond what it kept of the prompt (Compressor's extra_rows)."),
    codecs: Optional[str] = typer.Option(None, help="reuse: comma-separated store codecs (default: raw, quant:kivi-8/4/2, cachegen)."),
    clients: int = typer.Option(4, help="serve: concurrent clients."),
    duration: float = typer.Option(120, help="serve: seconds of load with the store on, then off."),
    soak: float = typer.Option(180, help="serve: seconds of each soak (Redis, or a cluster node, killed a third of the way in, restarted; 0: none)."),
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
    if first_sample and suite != "longctx":  # the other suites have no sample range: refuse, do not run them all
        raise KVMemError(f"--first-sample is for the longctx suite only; got --suite {suite}")
    if suite == "retrieval":
        from kvmem.embed import EMBEDDERS
        from kvmem_bench.retrieval.runner import run_retrieval
        from kvmem_bench.retrieval.sets import SETS

        out = out or Path("results/retrieval")
        run_retrieval(_csv(models), _csv(methods) if methods else list(EMBEDDERS), _csv(tasks) if tasks else list(SETS),
                      out, layers="all" if layers == "all" else _csv(layers, int), limit=limit)
        console.print(f"wrote {out / 'results.json'} and {out / 'report.md'}")
        return
    if suite == "speed":
        from kvmem_bench.speed.runner import SpeedConfig, run_speed

        cfg = SpeedConfig(models=_csv(models), lengths=_csv(lengths, int), threads=threads,
                          out=out or Path("results/speed"), **({"methods": _csv(methods)} if methods else {}))
        path = run_speed(cfg)
        console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")
        return
    if suite == "rag":
        from kvmem_bench.rag.runner import run_rag

        path = run_rag(_csv(models), _csv(methods) if methods else ("full", "none", "cacheblend", "infoflow"), samples,
                       _csv(ratios, float) if ratios != RATIOS_DEFAULT else [0.15], out or Path("results/rag"), seed)
        console.print(f"report: {path / 'report.md'}")
        return
    if suite == "reuse":
        from kvmem_bench.reuse.runner import DEFAULT_CODECS, PARTS, ReuseConfig, run_reuse

        chosen = [p for p in _csv(parts) if p in PARTS]
        cfg = ReuseConfig(models=_csv(models), lengths=_csv(lengths, int), codecs=_csv(codecs) if codecs else list(DEFAULT_CODECS),
                          out=out or Path("results/reuse"), threads=threads, task_samples=samples,
                          parts=tuple(chosen or ("ttft", "tasks", "semantic")))  # semshare: only when asked
        path = run_reuse(cfg, log=console.print)
        console.print(f"report: {path}")
        return
    if suite == "serve":
        import shlex

        from kvmem_bench.serve.runner import PHASES, run_load_suite

        chosen = tuple(p for p in _csv(parts) if p in PHASES) or PHASES
        report = run_load_suite(out or Path("results/serve"), _csv(models)[0], clients, duration, soak,
                                threads=threads or 1, workers=workers, phases=chosen, log=console.print,
                                command=shlex.join(["kvmem", *sys.argv[1:]]))
        console.print(f"report: {report}")
        return
    if suite == "batching":
        import shlex

        from kvmem_bench.batching.runner import MEMORY_CONFIGS, SERVERS, run_batching_suite

        report = run_batching_suite(out or Path("results/batching"), _csv(models)[0], tuple(_csv(lengths, int)),
                                    tuple(_csv(concurrency, int)), duration, max_tokens=128, threads=threads or 2,
                                    servers=tuple(_csv(servers)) if servers else SERVERS, memory_budget=kv_budget,
                                    memory_duration_s=memory_duration, memory_rounds=memory_rounds, sweep_rounds=sweep_rounds,
                                    memory_configs=tuple(_csv(methods)) if methods else tuple(MEMORY_CONFIGS),
                                    phases=tuple(p for p in _csv(parts) if p in ("sweep", "memory", "steps")) or ("sweep", "memory", "steps"),
                                    command=shlex.join(["kvmem", *sys.argv[1:]]), log=console.print)
        console.print(f"report: {report}")
        return
    if suite == "kvdirect":
        from kvmem.models import load_model
        from kvmem_bench.kvdirect.report import write_report
        from kvmem_bench.kvdirect.runner import KVDirectConfig, run_kvdirect_suite

        for model in _csv(models):
            cfg = KVDirectConfig(model=model, lengths=_csv(lengths, int), samples=samples, out=out or Path("results/kvdirect"),
                                 **({"evictions": _csv(methods)} if methods else {}),
                                 **({"parts": _csv(parts)} if parts != PARTS_DEFAULT else {}))
            cfg.validate()
            run_kvdirect_suite(load_model(model), cfg, log=console.print)
            console.print(f"report: {write_report(cfg.out)}")
        return
    if suite == "longgen":
        from kvmem.models import load_model
        from kvmem_bench.longgen.report import write_report
        from kvmem_bench.longgen.runner import LongGenConfig, run_longgen_suite

        cfg = LongGenConfig(model=_csv(models)[0], every=every, extra_rows=extra_rows, samples=samples, texts=texts, out=out or Path("results/longgen"),
                            **({"methods": _csv(methods)} if methods else {}),
                            **({"ratios": _csv(ratios, float)} if ratios != RATIOS_DEFAULT else {}),
                            **({"parts": _csv(parts)} if parts != PARTS_DEFAULT else {}))
        cfg.validate()
        run_longgen_suite(load_model(cfg.model), cfg, log=console.print)
        console.print(f"report: {write_report(cfg.out)}")
        return
    if suite == "quant":
        from kvmem_bench.quant.runner import QuantConfig, default_schemes, run_quant

        length = _csv(lengths, int)[0]
        cfg = QuantConfig(models=_csv(models), schemes=_csv(quant) if quant else default_schemes(), parts=_csv(parts),
                          length=length, texts=texts, decode_length=length, task_length=length, task_samples=samples,
                          task_ratios=_csv(ratios, float), out=out or Path("results/quant"),
                          **({"task_methods": _csv(methods)} if methods else {}),
                          **({"task_schemes": _csv(cross)} if cross else {}),
                          task_settings=tuple(_csv(eval_settings or "agnostic")))
        path = run_quant(cfg, log=console.print)
        console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")
        return
    out = out or Path("results/longctx")
    from kvmem.compress import METHODS
    from kvmem_bench.longctx.runner import ALL_TASKS, EvalConfig, run

    if suite != "longctx":
        raise KVMemError(f"unknown suite {suite!r}; available: longctx, retrieval, speed, quant, reuse, rag, serve, batching, longgen, kvdirect")
    cfg = EvalConfig(
        models=_csv(models), lengths=_csv(lengths, int),
        tasks=_csv(tasks) if tasks else list(ALL_TASKS),
        methods=_csv(methods) if methods else [m for m in METHODS if not METHODS[m].decode_phase],
        ratios=_csv(ratios, float), samples=samples, first_sample=first_sample, seed=seed, out=out, raw_prompt=raw_prompt,
        settings=tuple(_csv(eval_settings or "agnostic,aware")),
    )
    path = run(cfg)
    console.print(f"wrote {path / 'results.json'} and {path / 'report.md'}")


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
    tasks: Optional[str] = typer.Option(None, help="Comma-separated tasks (default: every usable task the suite swept)."),
    ratios: Optional[str] = typer.Option(None, help="Comma-separated keep ratios (default: 0.5,0.25,0.1)."),
) -> None:
    """Race kvpress on the suite's prompts: its presses run in their own virtualenv on the same token ids, and
    their answers are scored like kvmem's. Resumable; rebuilds the suite's report with the race in it."""
    from kvmem_bench.longctx.race import race as run_race

    path = run_race(bench, out, venv, _csv(models) if models else None, _csv(lengths, int) if lengths else None,
                    samples, threads, check, _csv(presses) if presses else None, first, tuple(_csv(settings)),
                    _csv(tasks) if tasks else None, _csv(ratios, float) if ratios else None)
    console.print(f"wrote {path}")

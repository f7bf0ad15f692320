"""The `kvmem` command line: generate, embed, serve, methods, models; plus the commands of installed plugins (entry
point group `kvmem.cli`: a function that adds commands to `app`). The benchmark package, kvmem-bench (`bench/`),
adds demo, eval and race."""

from __future__ import annotations

import functools
import os
import warnings
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

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


def _check_cache_options(method: str, keep_ratio: float, quant: str | None, store: str | None = None,
                         serving: bool = False) -> None:
    """The compression method, keep ratio and quantization scheme, checked before a model loads."""
    from kvmem.compress import get_method
    from kvmem.compress.evict import check_keep_ratio
    from kvmem.kvdirect import check_call, is_kv_direct
    from kvmem.quant import get_scheme

    if is_kv_direct(method):  # not an eviction method: a window of K/V and residual checkpoints (kvdirect.py)
        if serving:
            raise KVMemError(f"{method}: the server's batched decoding does not run KV-Direct caches (kvmem generate does)")
        check_call(method, keep_ratio, quant, store)
        return
    m = get_method(method)
    if quant:
        get_scheme(quant)
    check_keep_ratio(keep_ratio, 1)
    if m.name == "full" and keep_ratio < 1.0:
        raise KVMemError("method 'full' keeps every token; use --keep-ratio 1.0 or another method")


@app.command()
@clean_errors
def generate(
    prompt: str = typer.Option(..., help="The question or instruction, fed after the context."),
    context_file: Optional[Path] = typer.Option(None, help="A text file read (and compressed) before the prompt."),
    model: str = typer.Option("smollm2-135m", help="Registry name, local folder or HF id."),
    method: str = typer.Option("snapkv", help="Compression method or spec, e.g. kvzip, snapkv:window=64:budget=adaptive (see `kvmem methods`); "
                               "kv-direct:window=256:checkpoint=layer|tokens (with --keep-ratio 1) keeps the last 256 tokens' KV and "
                               "residual checkpoints of the rest."),
    keep_ratio: float = typer.Option(0.5, help="Fraction of the context's KV cache kept, in (0, 1]."),
    query_aware: bool = typer.Option(False, help="Compress after reading the prompt too (not reusable across prompts)."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate (stops at end of line)."),
    raw_prompt: bool = typer.Option(False, help="No chat template: the context and prompt as plain text (base models)."),
    quant: Optional[str] = typer.Option(None, help="Hold the cache quantized, e.g. kivi-2, kivi-4:group=64 (after eviction)."),
    store: Optional[str] = typer.Option(None, help="Keep and reuse computed KV: tiers fastest first, e.g. "
                                        "memory,disk:///tmp/kvmem,redis://127.0.0.1:6379/0 (a Redis Cluster: redis+cluster://h:p,h:p,...)."),
    codec: str = typer.Option("raw", help="How the store encodes chunks: raw, quant:<scheme> (e.g. quant:kivi-8), cachegen."),
    chunk_size: int = typer.Option(256, help="Tokens per stored chunk."),
    store_write: str = typer.Option("through", help="Store writes: through (every tier) or memory (the first tier only)."),
    reuse: str = typer.Option("prefix", help="With --store: prefix (the longest stored prefix, in chunks), semantic (the "
                              "remembered prompt nearest by embedding, to the token) or semshare (a similar prompt's KV "
                              "aligned token by token, some recomputed); semantic/semshare need --semantic-index and "
                              "--method full --keep-ratio 1."),
    semantic_index: Optional[Path] = typer.Option(None, help="With --reuse semantic/semshare: the file of remembered "
                                                  "prompts (read if there, written after the run)."),
    semantic_embedder: str = typer.Option("minilm", help="How the semantic index embeds prompts (a kvmem.embed method)."),
    recompute_ratio: float = typer.Option(0.15, help="--reuse semshare: share of the aligned tokens recomputed."),
) -> None:
    """Read a context, compress its KV cache, answer the prompt; prints the answer and the memory held. With
    --store, computed KV is kept and a later run on the same context reuses it (and says how much)."""
    from kvmem.generate import REUSE, answer, check_reuse
    from kvmem.kvdirect import is_kv_direct
    from kvmem.models import load_model

    _check_cache_options(method, keep_ratio, quant, store)  # fail on a bad option before loading anything
    chunks = index = None
    if reuse not in REUSE:
        raise KVMemError(f"--reuse {reuse}: choose from {', '.join(REUSE)}")
    if reuse != "prefix" and not (store and semantic_index):
        raise KVMemError(f"--reuse {reuse} needs --store (where the KV is kept) and --semantic-index (where the "
                         "remembered prompts are kept between runs)")
    if store:
        from kvmem.store import ChunkStore

        chunks = ChunkStore(store, codec, chunk_size, store_write)  # a bad tier, codec or size fails before the model loads
    if reuse != "prefix":
        from kvmem.reuse.semantic_index import SemanticIndex

        if not 0.0 <= recompute_ratio <= 1.0:
            raise KVMemError(f"--recompute-ratio must be in [0, 1]; got {recompute_ratio}")
        index = SemanticIndex(chunks, semantic_embedder, path=semantic_index)
        check_reuse(reuse, index, chunks, method, keep_ratio, quant)
    context = context_file.read_text() if context_file else ""
    lm = load_model(model)
    a = answer(lm, context, prompt, method, keep_ratio, query_aware, max_new_tokens, raw_prompt=raw_prompt, quant=quant,
               store=chunks, reuse=reuse, index=index, recompute_ratio=recompute_ratio)
    if index is not None:
        index.save()
    console.print(a.text.strip(), highlight=False)
    if a.reuse is not None:
        from rich.markup import escape  # the summary's own brackets are text, not markup

        console.print(f"[dim]store {', '.join(t.name for t in chunks.tiers)} ({chunks.codec.spec}): "
                      f"{escape(a.reuse.summary())}[/dim]", highlight=False)
    held = "KV window + residual checkpoints held" if is_kv_direct(method) else "KV held"
    console.print(f"[dim]{held} {a.kv_bytes / 2**20:.2f} MiB of {a.kv_bytes_full / 2**20:.2f} MiB "
                  f"({a.kv_bytes / max(a.kv_bytes_full, 1):.2f}), method {method}"
                  f"{f', quantized {quant}' if quant else ''}[/dim]", highlight=False)


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

    from kvmem.compress import BUDGETS, METHODS, OFFLOAD
    from kvmem.embed import EMBEDDERS

    def options(cls, skip=("self", "model", "tokenizer", "layer")) -> list[str]:
        return [f"{p.name}={p.default!r}" for p in inspect.signature(cls.__init__).parameters.values()
                if p.name not in skip and p.default is not p.empty]

    console.print("[bold underline]compression[/bold underline] (kvmem generate/eval --method NAME[:option=value...])")
    own = ", ".join(name for name, cls in METHODS.items() if cls.budgets == ())
    console.print(f"every method (but those that size their heads themselves: {own}) also takes budget= one of "
                  f"{', '.join(BUDGETS)} (see kvmem/compress/budget.py), and "
                  "sliding=keep (leave sliding-window layers whole) or sliding=compress (the default)")
    for name, cls in METHODS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        opts = options(cls) + ([f"budget={cls.budget!r}"] if cls.budget != "uniform" else [])
        console.print(f"[bold]{name}[/bold]: {' '.join(doc[:3])}" + (f"  options: {', '.join(opts)}" if opts else ""),
                      highlight=False)
    console.print("\n[bold underline]offload and retrieve[/bold underline] (--method NAME; the keep ratio is the "
                  "resident fraction, every row stays in a slower tier)")
    for name, cls in OFFLOAD.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        console.print(f"[bold]{name}[/bold]: {doc[0] if doc else ''}  options: {', '.join(options(cls))}", highlight=False)
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
                                        "Redis): tiers fastest first, e.g. memory,disk:///tmp/kvmem,redis://127.0.0.1:6379/0 (a Redis "
                                        "Cluster: redis+cluster://h:p,h:p,...)."),
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
    reuse: str = typer.Option("prefix", help="Default reuse of stored KV (a request's kvmem.reuse overrides it): prefix, "
                              "semantic (token recycling through the semantic index) or semshare (a similar prompt's KV "
                              "aligned token by token); semantic and semshare need --store."),
    semantic_index: Optional[Path] = typer.Option(None, help="With --store: the file of the semantic index's remembered "
                                                  "prompts (read at start, written at shutdown); without it the index "
                                                  "lives in memory."),
    semantic_embedder: str = typer.Option("minilm", help="How the semantic index embeds prompts (a kvmem.embed method)."),
    recompute_ratio: float = typer.Option(0.15, help="Default share of reused tokens recomputed (semshare, cacheblend, "
                                          "infoflow)."),
    log_level: str = typer.Option("info", help="uvicorn's log level."),
    api_key: Optional[str] = typer.Option(None, envvar="KVMEM_API_KEY", help="Require 'Authorization: Bearer KEY' on "
                                          "/v1/* (401 otherwise); /health and /metrics stay open."),
    cors_origins: Optional[str] = typer.Option(None, help="Browser origins allowed to call the API (CORS), comma-separated, "
                                               "e.g. http://localhost:3000,https://app.example.com; * for any."),
    access_log: bool = typer.Option(True, help="One JSON line per request on stderr (logger kvmem.access): x-request-id, "
                                    "method, path, status, duration, model, user, tokens."),
) -> None:
    """An OpenAI-compatible HTTP server (chat and text completions, streaming, embeddings, /metrics) with the
    cache layer inside: per-request compression and quantization, KV reused from the store. Every response carries
    an x-request-id header (the request's own, or a new one), also in the access log."""
    import torch
    import uvicorn

    from kvmem.embed import parse_method
    from kvmem.models import load_model
    from kvmem.serve.app import create_app
    from kvmem.serve.engine import Options

    from kvmem.serve.engine import REUSE_MODES, SEMANTIC_MODES

    _check_cache_options(method, keep_ratio, quant, serving=True)
    parse_method(embed_method)
    if reuse not in REUSE_MODES or reuse in ("cacheblend", "infoflow"):
        raise KVMemError(f"--reuse {reuse}: choose from prefix, {', '.join(SEMANTIC_MODES)} (cacheblend and infoflow are "
                         "per request, with documents)")
    if not 0.0 <= recompute_ratio <= 1.0:
        raise KVMemError(f"--recompute-ratio must be in [0, 1]; got {recompute_ratio}")
    chunks = index = None
    if store:
        from kvmem.reuse.semantic_index import SemanticIndex
        from kvmem.store import ChunkStore

        chunks = ChunkStore(store, codec, chunk_size, store_write)
        index = SemanticIndex(chunks, semantic_embedder, path=semantic_index)
    elif reuse != "prefix" or semantic_index:
        raise KVMemError(f"--reuse {reuse} / --semantic-index need --store (where the remembered prompts' KV is kept)")
    if threads:
        torch.set_num_threads(threads)
    budget = _kv_budget(kv_budget) if batching else None
    if max_batch < 1 or queue < 0:
        raise KVMemError(f"--max-batch must be >= 1 and --queue >= 0 (got {max_batch}, {queue})")
    if api_key is not None and not api_key.strip():
        raise KVMemError("--api-key (or KVMEM_API_KEY) is empty; give a key or leave it out")
    lm = load_model(model)
    app_ = create_app(lm, chunks, Options(method=method, keep_ratio=keep_ratio, quant=quant, reuse=reuse,
                                          recompute_ratio=recompute_ratio), workers, queue, timeout,
                      max_tokens, max_n, embed_method, budget, max_batch, api_key,
                      _csv(cors_origins) if cors_origins else None, index)
    if access_log:
        import logging

        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("kvmem.access").addHandler(handler)
        logging.getLogger("kvmem.access").setLevel(logging.INFO)
    how = f"continuous batching, KV budget {budget / 2**20:.0f} MiB" if batching else f"{workers} worker(s)"
    console.print(f"kvmem serve: {lm.name} on http://{host}:{port}/v1 (store: {chunks or 'none'}; {how}, "
                  f"queue {queue}, {torch.get_num_threads()} torch threads)", highlight=False)
    uvicorn.run(app_, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                access_log=not access_log)  # ours has the id and the tokens


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


_plugins_loaded = False


def load_plugins() -> typer.Typer:
    """Add the commands of every installed plugin (entry point group `kvmem.cli`; kvmem-bench adds demo, eval and
    race) to `app`, once. Not at import: a plugin imports this module for its helpers."""
    global _plugins_loaded
    if not _plugins_loaded:
        from importlib.metadata import entry_points

        _plugins_loaded = True
        for plugin in entry_points(group="kvmem.cli"):
            plugin.load()(app)
    return app


def main() -> None:
    """The `kvmem` command: kvmem's own commands and its plugins'."""
    load_plugins()()


if __name__ == "__main__":
    main()

"""Exact-prefix reuse: load the longest stored prefix of a prompt, prefill only the rest, store what is new.

A prompt is prefilled in chunk-aligned pieces (the store's chunk size; the last piece may be shorter), so
a run that loads chunks 0..k-1 computes chunks k.. exactly as a run that loaded nothing: with the `raw`
codec the logits are bit-identical with and without reuse. (A chunked prefill differs from one big
forward by float rounding only.) After each full chunk is computed, its rows are saved.

A compressed context is stored whole, as one span (`load_span` / `save_span`): its rows depend on every
token the scorer saw, so it is valid only for exactly those tokens. Its positions and per-head budgets
come back as they were.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.quant import QuantizedRows
from kvmem.reuse.pipeline import LayerFailed, LayerLoader
from kvmem.rows import GROW, ExportedRows
from kvmem.store.store import ChunkStore, Loaded, Opened, StoreWarning


@dataclass
class ReuseReport:
    """What a prefill took from the store and what it computed, with the load time broken down."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    chunks_loaded: int = 0
    chunks_saved: int = 0
    tiers: Counter = field(default_factory=Counter)
    bytes_read: int = 0
    read_s: float = 0.0
    decode_s: float = 0.0
    import_s: float = 0.0
    wait_s: float = 0.0  # of prefill_s: the forward waiting for a stored layer to be in place (`pipeline.py`)
    prefill_s: float = 0.0
    saved_compute_s: float = 0.0  # what the loaded chunks cost to compute when they were stored
    span: bool = False  # a whole compressed context came from the store
    full_kv_bytes: int | None = None  # a loaded compressed context: the bytes it held before compression
    failed_loads: int = 0  # loads abandoned when a stored layer failed verification mid-forward (then recomputed)

    @property
    def load_s(self) -> float:
        return self.read_s + self.decode_s + self.import_s

    def summary(self) -> str:
        if not self.reused_tokens:
            return f"reused nothing from the store; prefilled {self.computed_tokens} tokens in {self.prefill_s:.2f} s" + (
                f", stored {self.chunks_saved} chunks" if self.chunks_saved else "")
        where = ", ".join(f"{n} from {t}" for t, n in self.tiers.items())
        what = "a compressed context of" if self.span else f"{self.chunks_loaded} chunks,"
        return (f"reused {self.reused_tokens} of {self.prompt_tokens} prompt tokens ({what} {self.bytes_read / 2**20:.1f} MiB; "
                f"{where}) in {self.load_s:.3f} s (read {self.read_s:.3f}, decode {self.decode_s:.3f}, import "
                f"{self.import_s:.3f}; the forward waited {self.wait_s:.3f} for layers); prefilled {self.computed_tokens} "
                f"tokens in {self.prefill_s:.2f} s; the reused "
                f"part took {self.saved_compute_s:.2f} s to compute")

    def add_load(self, got: Loaded | Opened, tokens: int) -> None:
        self.reused_tokens += tokens
        self.tiers[got.tier] += 1
        self.bytes_read += got.nbytes
        self.read_s += got.read_s
        self.decode_s += got.decode_s
        self.saved_compute_s += got.compute_s or 0.0


def chunk_rows(cache: KVCache, start: int, end: int) -> list[ExportedRows]:
    """Every layer's rows at positions [start, end), copied (full precision, as attention reads them)."""
    if any(getattr(layer.rows, "retrieves", False) for layer in cache.layers):  # its resident rows are not the context
        raise KVMemError("an offloaded cache is not exported: its rows are split between a tier and a working set "
                         "(store the full cache before offloading it)")
    out = []
    for layer in cache.layers:
        heads = []
        for h, (k, v, p) in enumerate(layer.rows.heads()):
            sel = ((p >= start) & (p < end)).nonzero().flatten()
            head = {"keys": k.index_select(0, sel).clone(), "values": v.index_select(0, sel).clone(),
                    "positions": p.index_select(0, sel).clone()}
            if layer.log_weights is not None:
                head["log_weights"] = layer.log_weights[h].index_select(0, sel).clone()
            heads.append(head)
        out.append(ExportedRows(heads))
    return out


TAIL = "context-tail"  # the namespace of a context's last, partial chunk (valid for exactly that context)


@torch.no_grad()
def prefill(lm, cache: KVCache, ids: list[int], store: ChunkStore | None, min_tail: int = 1,
            report: ReuseReport | None = None, context_end: int | None = None,
            interrupt=None, overlap: bool = True) -> tuple[torch.Tensor, ReuseReport]:
    """Prefill `ids` into the empty `cache` in chunk-aligned pieces, loading the longest stored prefix first (at
    least `min_tail` tokens are computed: the last token's logits are needed, and a scorer may need the queries
    of the last tokens) and saving every full chunk computed. Returns the last token's logits and the report.

    `context_end`: where the reusable context ends (`Prompt.context`; the question follows). Its last, partial
    chunk is stored too, under a key of exactly the context's tokens, so a request with the same context and
    another question computes only the question; a piece also ends there, so cold and warm runs compute the
    same pieces (raw reuse stays bit-identical). `interrupt()` is called before each piece (it raises to stop: the
    server's cancelled requests). The stored layers are put in place while the forward runs (`pipeline.py`);
    `overlap=False` puts every layer in place before the forward starts (the benchmark's comparison)."""
    ids = list(ids)
    if not ids:
        raise KVMemError("nothing to prefill: empty token list")
    if len(ids) > lm.max_context:
        raise KVMemError(f"context too long: {len(ids)} tokens > {lm.max_context} that {lm.name} allows")
    if context_end is not None and not 0 < context_end <= len(ids):
        raise KVMemError(f"context_end {context_end} is outside the {len(ids)} tokens")
    report = report or ReuseReport()
    report.prompt_tokens = len(ids)
    n = store.chunk_size if store is not None else len(ids)
    limit = len(ids) - max(min_tail, 1)  # tokens that may come from the store
    keys = store.keys(lm, ids) if store is not None else []
    # the stored prefix: full chunks, then the context's partial last chunk (stored under a key of exactly the
    # context), each read while the one before has its header checked; their layers are verified and put in place by a
    # loader thread while the forward runs (`pipeline.py`)
    pieces = [(key, i * n, n, None, None) for i, key in enumerate(keys) if (i + 1) * n <= limit]
    tail_key = None
    if store is not None and context_end is not None and context_end % n:
        tail_key = store.span_key(lm, ids[:context_end], TAIL)
        if len(pieces) == context_end // n and context_end <= limit:
            pieces.append((tail_key, len(pieces) * n, context_end % n, TAIL, True))
    opened, start = [], 0
    for piece, got in zip(pieces, store.open_run(lm, pieces, views=True) if pieces else ()):
        if got is None:
            break
        opened.append(got)
        start = piece[1] + piece[2]
    if tail_key is not None and start == context_end and opened:
        tail_key = None  # loaded, so stored already
    elif tail_key is not None and start == context_end // n * n and context_end <= limit and (not pieces or pieces[-1][3] != TAIL):
        # the prompt's chunks went on past the context and missed where it ends: its partial last chunk may be stored
        got = store.open(lm, tail_key, start, context_end - start, TAIL, exact=True, views=True)
        if got is not None:
            opened.append(got)
            start, tail_key = context_end, None
    if not opened:
        return compute_rest(lm, cache, ids, 0, store, keys, n, report, context_end, tail_key, interrupt), report
    loader = LayerLoader(cache, opened, start, spare=len(ids) - start + GROW)  # rows for the rest and the first answer
    failed = None
    try:
        if not overlap:
            loader.wait_all()
        logits = compute_rest(lm, cache, ids, start, store, keys, n, report, context_end, tail_key, interrupt)
    except LayerFailed as e:
        failed = e
    finally:
        loader.close()
    if failed is not None:  # nothing of this attempt is kept: prefill again, without the chunk (and what follows it)
        store.reject(failed.opened.key, failed.opened.tier, failed.error)
        for layer in cache.layers:
            layer.reset()
        report.failed_loads += 1
        return prefill(lm, cache, ids, store, min_tail, report, context_end, interrupt, overlap)
    for got in opened:
        report.add_load(got, got.tokens)
    report.chunks_loaded = len(opened)
    report.import_s += loader.import_s
    report.wait_s += loader.wait_s if overlap else 0.0  # (sequential: the forward never waits; the load came first)
    return logits, report


def compute_rest(lm, cache: KVCache, ids: list[int], start: int, store: ChunkStore | None, keys: list[str], n: int,
                 report: ReuseReport, context_end: int | None = None, tail_key: str | None = None,
                 interrupt=None) -> torch.Tensor:
    """Prefill ids[start:] on top of the cache in pieces that end on chunk boundaries and at `context_end` (`start`
    may fall inside a chunk), saving each chunk completed (its first rows may have been loaded) and, under
    `tail_key`, the context's partial last chunk; returns the last token's logits."""
    from kvmem.forward import feed

    logits = None
    t_all = time.perf_counter()
    s = start
    while s < len(ids):
        e = min((s // n + 1) * n, len(ids))
        if context_end is not None and s < context_end < e:
            e = context_end
        if interrupt is not None:
            interrupt()
        t = time.perf_counter()
        logits = feed(lm, cache, ids[s:e])
        if store is not None and e % n == 0:
            report.chunks_saved += store.save(lm, keys[e // n - 1], chunk_rows(cache, e - n, e), e - n, n,
                                              compute_s=time.perf_counter() - t)
        elif store is not None and tail_key is not None and e == context_end:
            a = e // n * n
            report.chunks_saved += store.save(lm, tail_key, chunk_rows(cache, a, e), a, e - a, TAIL,
                                              compute_s=time.perf_counter() - t)
        s = e
    report.prefill_s = time.perf_counter() - t_all
    report.computed_tokens = len(ids) - start
    return logits


def load_span(lm, cache: KVCache, store: ChunkStore, ids: list[int], compression: str,
              report: ReuseReport) -> bool:
    """Load the compressed rows stored for exactly the context `ids` into the empty `cache`; False on a miss."""
    got = store.load(lm, store.span_key(lm, ids, compression), 0, len(ids), compression)
    if got is None:
        return False
    t = time.perf_counter()
    try:
        for layer, rows in zip(cache.layers, got.layers):
            layer.import_rows(rows, len(ids))
    except KVMemError as e:  # rows held encoded are checked here, against the layer's scheme: never decode from bad ones
        warnings.warn(f"kvmem store: span {store.span_key(lm, ids, compression)[:12]} discarded ({e}); recomputing",
                      StoreWarning, stacklevel=2)
        store.discard(store.span_key(lm, ids, compression))
        for layer in cache.layers:
            layer.reset()
        return False
    report.import_s += time.perf_counter() - t
    report.add_load(got, len(ids))
    report.chunks_loaded, report.span, report.prompt_tokens = 1, True, len(ids)
    report.full_kv_bytes = (got.info or {}).get("full_kv_bytes")
    return True


def save_span(lm, cache: KVCache, store: ChunkStore, ids: list[int], compression: str, compute_s: float,
              full_kv_bytes: int | None = None) -> bool:
    """Store the compressed context the cache holds for exactly `ids` (and the bytes it held uncompressed). Quantized
    layers go as held, still encoded, where the store's codec keeps them so (`raw`): loading them re-encodes nothing."""
    held = store.codec.carries_encoded and all(type(layer.rows) is QuantizedRows for layer in cache.layers)
    layers = [layer.export_rows() for layer in cache.layers] if held else chunk_rows(cache, 0, len(ids))
    return store.save(lm, store.span_key(lm, ids, compression), layers, 0, len(ids), compression, compute_s,
                      {"full_kv_bytes": full_kv_bytes})

"""`ChunkStore`: computed KV kept across requests, in tiers, verified on every read.

    store = ChunkStore("memory,disk:///tmp/kvmem", codec="raw", chunk_size=256)
    keys = store.keys(lm, ids)                      # one per full chunk of ids (keys.py)
    store.save(lm, keys[0], rows, start=0, tokens=256)
    rows = store.load(lm, keys[0], start=0, tokens=256)   # list[ExportedRows] per layer, or None
    opened = store.open(lm, keys[0], start=0, tokens=256)  # header verified; opened.layer(l) verifies and decodes one

Reads go through the tiers fastest first and promote a hit to the faster tiers. Writes go to every tier
(`write="through"`) or to the first only (`write="memory"`). What goes wrong never reaches the caller as
an exception: a tier that cannot be reached (Redis down), is full or read-only is skipped with a
`StoreWarning` and a counter (`store.stats`), and the caller recomputes. A Redis Cluster tier with one node
down fails only for that node's chunks (`NodeDown`): they are misses and skipped writes, counted and warned
about the same way, while its other nodes keep serving. A chunk read back is used only if
its frame's digests (the header's, and each layer's as that layer is read), model fingerprint, tokenizer, codec and codec version, key, token range and row
layout all match what was asked for; otherwise it is deleted from every tier, counted as `corrupt`, and
the caller recomputes.
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from kvmem.errors import KVMemError
from kvmem.rows import DenseExport, ExportedRows
from kvmem.store import chunk
from kvmem.store.codec import Codec
from kvmem.store.codecs import get_codec
from kvmem.store.keys import chunk_keys, namespace, span_key
from kvmem.store.tiers import NodeDown, Tier, parse_stack

FORMAT = 1  # the chunk header's layout
READ_AHEAD = 2  # pieces whose bytes `open_run` reads at once ahead of the one being checked


class StoreWarning(UserWarning):
    """Something in the store failed and kvmem recomputed instead (see `ChunkStore.stats`)."""


def layer_windows(config) -> list[int | None]:
    """Per decoder layer, the sliding window (None for global attention), as KVCache builds its layers."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [text.sliding_window if t == "sliding_attention" else None for t in types[:text.num_hidden_layers]]


def expected_positions(window: int | None, start: int, end: int) -> range:
    """The positions of chunk [start, end) an uncompressed layer holds right after computing it: all of them,
    or on a sliding layer those the next token can still see (positions > end - window)."""
    return range(max(start, end - window + 1), end) if window else range(start, end)


class ChunkStore:
    def __init__(self, tiers: str | list[Tier], codec: str | Codec = "raw", chunk_size: int = 256,
                 write: str = "through", retry_s: float = 5.0):
        if chunk_size < 1:
            raise KVMemError(f"chunk size must be >= 1 token, got {chunk_size}")
        if write not in ("through", "memory"):
            raise KVMemError(f"store write policy {write!r}: use 'through' (every tier) or 'memory' (the first tier only)")
        self.tiers = parse_stack(tiers) if isinstance(tiers, str) else list(tiers)
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        group = getattr(getattr(self.codec, "scheme", None), "group", 1)
        if chunk_size % group:
            raise KVMemError(f"chunk size {chunk_size} is not a multiple of {self.codec.spec}'s group of {group} tokens "
                             f"(the rest of each chunk would be stored unquantized)")
        self.chunk_size, self.write, self.retry_s = chunk_size, write, retry_s
        self.stats: Counter = Counter()
        self.reads = self.writes = True  # see `policy`
        self._lock = threading.Lock()  # the store is shared by concurrent requests (the server's threads)
        self._down_until: dict[int, float] = {}
        self._codecs: dict[str, Codec] = {}
        self._listeners: list = []  # called with each key a tier evicted or a failed check discarded (`subscribe`)
        for tier in self.tiers:
            tier.on_evict = self._evicted

    def subscribe(self, listener) -> None:
        """Call `listener(key)` whenever a tier evicts a chunk to make room or a chunk that failed verification is
        discarded (the key may still be held by another tier: see `held`). Policy views share the listeners."""
        self._listeners.append(listener)

    def _evicted(self, key: str) -> None:
        self._count("evicted")
        self._gone(key)

    def _gone(self, key: str) -> None:
        for listener in list(self._listeners):
            listener(key)

    def held(self, key: str) -> bool | None:
        """Whether some tier holds `key` now: True, False, or None when a tier that may hold it cannot be asked."""
        unknown = False
        for i, tier in enumerate(self.tiers):
            if not self._usable(i):
                unknown = True
                continue
            try:
                if tier.contains(key):
                    return True
            except NodeDown:
                unknown = True
            except Exception as e:  # noqa: BLE001
                self._failed(i, "read", e)
                unknown = True
        return None if unknown else False

    def policy(self, read: bool = True, write: bool = True) -> "ChunkStore":
        """A view of this store (same tiers, counters and codecs) that only reads or only writes, or neither: the
        server's per-request `use_store` / `fill_store`."""
        view = copy.copy(self)
        view.reads, view.writes = read, write
        return view

    def _count(self, event: str, n: int = 1) -> None:
        with self._lock:
            self.stats[event] += n

    def __repr__(self) -> str:
        return f"ChunkStore({','.join(t.name for t in self.tiers)}, codec={self.codec.spec}, chunk={self.chunk_size})"

    # -- bytes, across tiers ------------------------------------------------------------------------
    def _usable(self, i: int) -> bool:
        return self._down_until.get(i, 0.0) <= time.monotonic()

    def _failed(self, i: int, op: str, error: Exception) -> None:
        self._count("unavailable")
        self._down_until[i] = time.monotonic() + self.retry_s
        warnings.warn(f"kvmem store: tier {self.tiers[i].name} failed on {op} ({type(error).__name__}: {error}); "
                      f"skipping it for {self.retry_s:g} s and recomputing instead", StoreWarning, stacklevel=3)

    def _node_failed(self, i: int, op: str, error: NodeDown) -> None:
        self._count("unavailable")  # the tier stays usable: only this node's chunks are recomputed
        warnings.warn(f"kvmem store: tier {self.tiers[i].name} failed on {op}: {error}; recomputing instead",
                      StoreWarning, stacklevel=3)

    def get_bytes(self, key: str) -> tuple[bytes | None, str | None]:
        """The bytes stored under `key` from the fastest tier that has them (promoted to the faster tiers)."""
        if not self.reads:
            return None, None
        for i, tier in enumerate(self.tiers):
            if not self._usable(i):
                continue
            try:
                blob = tier.get(key)
            except NodeDown as e:
                self._node_failed(i, "read", e)
                continue
            except Exception as e:  # noqa: BLE001 - any tier failure degrades to a miss
                self._failed(i, "read", e)
                continue
            if blob is None:
                continue
            self._count(f"hit:{tier.name}")
            for j in range(i):
                self._put_one(j, key, blob)
            return blob, tier.name
        self._count("miss")
        return None, None

    def _put_one(self, i: int, key: str, blob: bytes) -> bool:
        if not self._usable(i):
            return False
        try:
            result = self.tiers[i].put(key, blob)
        except NodeDown as e:
            self._node_failed(i, "write", e)
            return False
        except Exception as e:  # noqa: BLE001
            self._failed(i, "write", e)
            return False
        if result != "ok":
            self._count(result)
            warnings.warn(f"kvmem store: tier {self.tiers[i].name} is {result}; chunk {key[:12]} not written there",
                          StoreWarning, stacklevel=3)
        return result == "ok"

    def put_bytes(self, key: str, blob: bytes) -> bool:
        """Write to every tier (write-through) or the first; True if at least one tier took it."""
        if not self.writes:
            return False
        targets = range(len(self.tiers)) if self.write == "through" else range(1)
        ok = [self._put_one(i, key, blob) for i in targets]
        self._count("write", any(ok))
        return any(ok)

    def discard(self, key: str) -> None:
        for i, tier in enumerate(self.tiers):
            if self._usable(i):
                try:
                    tier.delete(key)
                except NodeDown as e:
                    self._node_failed(i, "delete", e)
                except Exception as e:  # noqa: BLE001
                    self._failed(i, "delete", e)
        self._gone(key)

    # -- chunks of one model ------------------------------------------------------------------------
    def codec_for(self, lm) -> Codec:
        if lm.fingerprint not in self._codecs:
            self._codecs[lm.fingerprint] = self.codec.for_model(lm)
        return self._codecs[lm.fingerprint]

    def namespace(self, lm, compression: str | None = None) -> str:
        return namespace(lm.fingerprint, self.codec.spec, self.codec.version, compression, self.chunk_size)

    def keys(self, lm, ids: list[int], compression: str | None = None) -> list[str]:
        """Chained keys of the full chunks of `ids`."""
        return chunk_keys(list(ids), self.chunk_size, self.namespace(lm, compression))

    def span_key(self, lm, ids: list[int], compression: str) -> str:
        """The key of a whole compressed span (valid only for exactly these tokens)."""
        return span_key(list(ids), self.namespace(lm, compression))

    def _header(self, lm, key: str, start: int, tokens: int, compression: str | None) -> dict:
        return {"format": FORMAT, "key": key, "model": lm.fingerprint, "tokenizer": lm.tokenizer_id,
                "codec": self.codec.spec, "codec_version": self.codec.version, "compression": compression,
                "start": start, "tokens": tokens}

    def save(self, lm, key: str, layers: list[ExportedRows], start: int, tokens: int,
             compression: str | None = None, compute_s: float | None = None, info: dict | None = None) -> bool:
        """Encode and write one chunk (the rows of tokens [start, start + tokens) of every layer), with the time it
        took to compute and any JSON-able `info` the reader gets back."""
        tensors, meta = self.codec_for(lm).encode(layers)
        header = self._header(lm, key, start, tokens, compression) | {"codec_meta": meta, "compute_s": compute_s,
                                                                        "info": info}
        return self.put_bytes(key, chunk.pack(tensors, header))

    def load(self, lm, key: str, start: int, tokens: int, compression: str | None = None,
             exact: bool | None = None, views: bool = False) -> Loaded | None:
        """The verified rows of one chunk, or None (a miss, or a chunk that failed verification: discarded).
        `exact` (default: when uncompressed): every layer must hold every position an uncompressed layer holds.
        `views`: raw rows may view the stored bytes (`chunk.open_frame`): for a caller that copies them before any write."""
        opened = self.open(lm, key, start, tokens, compression, exact, views)
        return opened.decoded() if opened is not None else None

    def open(self, lm, key: str, start: int, tokens: int, compression: str | None = None,
             exact: bool | None = None, views: bool = False) -> Opened | None:
        """One chunk read and its header verified (model, tokenizer, codec, key, token range), or None (a miss, or a
        header that failed: discarded). Its layers are verified and decoded one at a time by `Opened.layer`."""
        t0 = time.perf_counter()
        blob, tier = self.get_bytes(key)
        return self._opened(lm, key, start, tokens, compression, exact, views, blob, tier, time.perf_counter() - t0)

    def open_run(self, lm, pieces: list[tuple], views: bool = False) -> Iterator[Opened | None]:
        """`open` of each piece, `(key, start, tokens, compression, exact)`, in order, reading the next `READ_AHEAD`
        pieces' bytes in threads while this one's header is checked (the GIL is released while a disk or Redis read's
        bytes arrive, and two reads fault in their fresh buffers on both cores). Each Opened's `read_s` is the time spent
        waiting for its bytes. A caller stops at the first None; what was read ahead past it is the only read wasted."""
        def read(key: str) -> tuple:
            t = time.perf_counter()
            return (*self.get_bytes(key), t)

        with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="kvmem-read") as pool:
            ahead = deque(pool.submit(read, piece[0]) for piece in pieces[:READ_AHEAD])
            for i, (key, start, tokens, compression, exact) in enumerate(pieces):
                t0 = time.perf_counter()
                blob, tier, began = ahead.popleft().result()
                waited = time.perf_counter() - max(t0, began)
                if blob is not None and i + READ_AHEAD < len(pieces):
                    ahead.append(pool.submit(read, pieces[i + READ_AHEAD][0]))
                got = self._opened(lm, key, start, tokens, compression, exact, views, blob, tier, waited)
                yield got
                if got is None:
                    return

    def reject(self, key: str, tier: str | None, error: Exception) -> None:
        """A chunk that failed verification: counted, warned about, deleted from every tier (the caller recomputes)."""
        self._count("corrupt")
        warnings.warn(f"kvmem store: chunk {key[:12]} from {tier} discarded ({error}); recomputing", StoreWarning,
                      stacklevel=3)
        self.discard(key)

    def _opened(self, lm, key: str, start: int, tokens: int, compression: str | None, exact: bool | None,
                views: bool, blob: bytes | None, tier: str | None, read_s: float) -> Opened | None:
        if blob is None:
            return None
        t1 = time.perf_counter()
        codec = self.codec_for(lm)
        try:
            frame = chunk.open_frame(blob, views)
            header = frame.header
            want = self._header(lm, key, start, tokens, compression)
            wrong = [f"{k} is {header.get(k)!r}, expected {v!r}" for k, v in want.items() if header.get(k) != v]
            if wrong:
                raise chunk.CorruptChunk("; ".join(wrong))
            n_layers = codec.layer_count(header.get("codec_meta") or {})
            if n_layers != len(layer_windows(lm.config)):
                raise chunk.CorruptChunk(f"{n_layers} layers, the model has {len(layer_windows(lm.config))}")
        except (KVMemError, KeyError, TypeError) as e:  # metadata of the wrong shape reads as corrupt, not as a crash
            self.reject(key, tier, e)
            return None
        exact = compression is None if exact is None else exact
        return Opened(self, lm, key, frame, codec, start, tokens, exact, tier, len(blob), read_s,
                      time.perf_counter() - t1)


class Opened:
    """A chunk read from a tier with its header verified. `layer(l)` verifies layer l's bytes (its own digest), decodes
    them and checks the rows against the model and the token range; it raises KVMemError if anything is wrong, and
    the caller rejects the chunk (`ChunkStore.reject`). `decode_s` sums the time spent verifying and decoding."""

    def __init__(self, store: ChunkStore, lm, key: str, frame: chunk.Frame, codec: Codec, start: int, tokens: int,
                 exact: bool, tier: str, nbytes: int, read_s: float, decode_s: float):
        self.store, self.lm, self.key, self.frame, self.codec = store, lm, key, frame, codec
        self.start, self.tokens, self.exact, self.tier, self.nbytes = start, tokens, exact, tier, nbytes
        self.read_s, self.decode_s = read_s, decode_s
        self.compute_s, self.info = frame.header.get("compute_s"), frame.header.get("info")
        self.shape = _ModelShape(lm)

    def layer(self, l: int) -> ExportedRows:
        t = time.perf_counter()
        try:
            self.frame.verify(str(l))
            rows = self.codec.decode_layer(self.frame.tensors, self.frame.header.get("codec_meta") or {}, l)
            _check_layer(self.shape, l, rows, self.start, self.start + self.tokens, self.exact)
        except (KeyError, TypeError, IndexError) as e:
            raise chunk.CorruptChunk(f"layer {l}: metadata does not fit its tensors ({type(e).__name__}: {e})") from None
        finally:
            self.decode_s += time.perf_counter() - t
        return rows

    def decoded(self) -> Loaded | None:
        """Every layer (`layer`), or None if one fails (the chunk is rejected)."""
        try:
            layers = [self.layer(l) for l in range(self.shape.n_layers)]
        except KVMemError as e:
            self.store.reject(self.key, self.tier, e)
            return None
        return Loaded(layers, self.tier, self.nbytes, self.read_s, self.decode_s, self.compute_s, self.info)


class Loaded:
    """A verified chunk: its rows per layer, where it came from, its size, and the read and decode times."""

    def __init__(self, layers: list[ExportedRows], tier: str, nbytes: int, read_s: float, decode_s: float,
                 compute_s: float | None, info: dict | None = None):
        self.layers, self.tier, self.nbytes, self.read_s, self.decode_s, self.compute_s, self.info = (
            layers, tier, nbytes, read_s, decode_s, compute_s, info)


class _ModelShape:
    """What rows must fit: per layer its sliding window, and the KV heads and head_dim."""

    def __init__(self, lm):
        text = lm.config.get_text_config()
        self.windows = layer_windows(lm.config)
        self.n_layers = len(self.windows)
        self.kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _check_layer(shape: _ModelShape, l: int, rows: ExportedRows, start: int, end: int, exact: bool) -> None:
    """Layer l's decoded rows fit the model and the token range (`exact`: every position an uncompressed layer holds)
    and are finite. A `DenseExport` layer is checked as its three tensors, not head by head (at 8k a load checks ~3k
    heads)."""
    kv_heads, head_dim = shape.kv_heads, shape.head_dim
    want = expected_positions(shape.windows[l], start, end) if exact else None
    want_t = torch.arange(want.start, want.stop, dtype=torch.int32) if want is not None else None
    if isinstance(rows, DenseExport):
        k, v, p = rows.keys, rows.values, rows.positions
        if k.dim() != 3 or k.shape[0] != kv_heads or k.shape[2] != head_dim or v.shape != k.shape or \
                p.shape != k.shape[:2]:
            raise chunk.CorruptChunk(f"layer {l}: keys {tuple(k.shape)}, values {tuple(v.shape)}, positions "
                                     f"{tuple(p.shape)} ({kv_heads} KV heads of head_dim {head_dim})")
        _check_positions(l, "every head", p, start, end, want, want_t)
        floats = [k, v]
    elif len(rows.heads) != kv_heads:
        raise chunk.CorruptChunk(f"layer {l}: {len(rows.heads)} KV heads, the model has {kv_heads}")
    elif rows.codec != "raw":  # a quantized layer's rows as held: its positions and residual here, its codes on import
        floats = _check_encoded(l, rows, head_dim, start, end)
    else:
        for h, head in enumerate(rows.heads):
            k, v, p = head["keys"], head["values"], head["positions"]
            if k.dim() != 2 or k.shape[1] != head_dim or v.shape[0] != k.shape[0] or p.shape != (k.shape[0],):
                raise chunk.CorruptChunk(f"layer {l} head {h}: keys {tuple(k.shape)}, values {tuple(v.shape)}, "
                                         f"positions {tuple(p.shape)} (head_dim {head_dim})")
            _check_positions(l, f"head {h}", p, start, end, want, want_t)
        floats = [t for head in rows.heads for t in (head["keys"], head["values"])]
    if not _finite(floats):
        raise chunk.CorruptChunk(f"layer {l}: non-finite keys, values, residual rows, scales or zero-points")


def _check_positions(l: int, what: str, p: torch.Tensor, start: int, end: int, want: range | None,
                     want_t: torch.Tensor | None) -> None:
    """Positions (..., T) of one head or (H, T) of a layer's heads: exactly `want` in order (an uncompressed chunk),
    else inside [start, end) and increasing along the rows."""
    if want_t is not None:  # every position, in order: one comparison
        if p.dtype != torch.int32 or p.shape[-1] != want_t.numel() or not torch.equal(p, want_t.expand_as(p)):
            raise chunk.CorruptChunk(f"layer {l} {what}: rows are not the positions {want.start}..{want.stop - 1} an "
                                     f"uncompressed chunk holds")
    elif p.dtype != torch.int32 or (p.numel() and (int(p.min()) < start or int(p.max()) >= end)) or (
            p.shape[-1] > 1 and not bool((p[..., 1:] > p[..., :-1]).all())):
        raise chunk.CorruptChunk(f"layer {l} {what}: positions outside [{start}, {end}) or not increasing")


def _check_encoded(l: int, rows: ExportedRows, head_dim: int, start: int, end: int) -> list[torch.Tensor]:
    """Rows a quantized layer held, as stored (`QuantizedRows.export_rows`): positions in range and increasing, residual
    rows of the model's head_dim; returns every float tensor (residual, scales, zero-points) for the caller's check that
    they are finite. The codes' shapes and counts are checked by `QuantizedRows.import_encoded` when the rows are imported."""
    for h, head in enumerate(rows.heads):
        p, rk, rv = head.get("positions"), head.get("residual_keys"), head.get("residual_values")
        if p is None or rk is None or rv is None:
            raise chunk.CorruptChunk(f"layer {l} head {h}: encoded rows without positions or residual rows")
        if p.dtype != torch.int32 or p.dim() != 1 or (p.numel() and (int(p.min()) < start or int(p.max()) >= end)) or (
                p.numel() > 1 and not bool((p[1:] > p[:-1]).all())):
            raise chunk.CorruptChunk(f"layer {l} head {h}: positions outside [{start}, {end}) or not increasing")
        if rk.dim() != 2 or rk.shape[1] != head_dim or rv.dim() != 2 or rv.shape[0] != rk.shape[0]:
            raise chunk.CorruptChunk(f"layer {l} head {h}: residual keys {tuple(rk.shape)}, values {tuple(rv.shape)} "
                                     f"(head_dim {head_dim})")
    return [t for head in rows.heads for t in head.values() if t.is_floating_point()]


def _finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or infinity in `tensors`: a sum is finite only if every term is (one pass at memory speed, where
    `isfinite` writes a mask), and the sums are tested together (one test a layer, not one a tensor). A sum that
    overflows on finite terms reads as corrupt: the chunk is recomputed, never trusted wrongly; a layer's KV sums to
    far below float32's range."""
    sums = [t.sum(dtype=torch.float32) for t in tensors if t.numel()]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())

"""The semantic index of remembered prompts (`reuse/semantic.py` has the prefill that uses it): a vector index of
their embeddings beside their token ids, over the `ChunkStore` that holds their KV; saved and loaded verified."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.reuse.prefix import chunk_rows
from kvmem.rows import ExportedRows
from kvmem.store.keys import chunk_keys, span_key
from kvmem.store.store import ChunkStore, expected_positions, layer_windows

ENTRIES_FORMAT = 1
DEFAULT_EMBEDDER = "minilm"


class IndexWarning(UserWarning):
    """A saved semantic index could not be used (missing pair file, corrupt, another embedder or tokenizer) and
    was rebuilt empty."""


@dataclass
class Match:
    """A remembered prompt proposed by the embedding, with its verified common token prefix with the query."""

    key: str
    common: int
    score: float
    ids: np.ndarray


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens two id arrays share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def prompt_key(store: ChunkStore, lm, ids: list[int]) -> str:
    """The store key of a remembered prompt's tail (and its name in the index)."""
    return span_key(list(ids), store.namespace(lm) + "|prompt")


def _ids_digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=20).digest()


def check_plain(cache: KVCache) -> None:
    if any(layer.compressor is not None or layer.quant is not None for layer in cache.layers):
        raise KVMemError("semantic reuse needs a plain cache (no compressor, no quantization): its rows are stored "
                         "and reused as exact prefixes")


class SemanticIndex:
    """Remembered prompts of one tokenizer: a vector index of their embeddings and their token ids, over a
    `ChunkStore` that holds their KV (see the module doc).

    `embedder`: a `kvmem.embed` method spec (default `minilm`, all-MiniLM-L6-v2: no second LLM pass; an LLM
    method such as `prompteol` or `mean` runs the served model over the text) or an object with
    `encode(text, normalize_embeddings=True)`. `embed_tokens`: how many leading tokens of a prompt are embedded
    (exact-prefix reuse only pays for a shared beginning, and it bounds an LLM embedder's cost; minilm itself
    reads 256 word pieces). `path`: where `save()` writes and where the index is read from, if there.

    Entries leave with their KV: a prompt whose stored pieces (its chunks and its tail) are no longer all held is
    dropped. The store tells the index each key a tier evicts to make room (memory LRU, disk budget) or discards
    after a failed check; at the index's next use, an entry with such a piece that no tier still holds is dropped.
    Evictions nobody reports (a Redis TTL or maxmemory, another process deleting files) are found at lookup: a
    proposed prompt whose piece is missing is dropped then; `prune()` checks every entry. At most `max_entries`
    prompts are kept; past that the least recently used leaves.
    """

    def __init__(self, store: ChunkStore, embedder=DEFAULT_EMBEDDER, path: str | os.PathLike | None = None,
                 embed_tokens: int | None = 256, max_entries: int = 100_000):
        if not isinstance(store, ChunkStore):
            raise KVMemError(f"a semantic index keeps its KV in a ChunkStore, got {type(store).__name__}")
        if embed_tokens is not None and embed_tokens < 1:
            raise KVMemError(f"embed_tokens must be >= 1 (or None: the whole prompt), got {embed_tokens}")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise KVMemError(f"max_entries must be a positive integer, got {max_entries!r}")
        self.store, self.embed_tokens, self.max_entries = store, embed_tokens, max_entries
        self._lock = threading.RLock()  # the server's requests share one index
        # keys the store reported gone, checked at the next use; bounded (a key left out is still caught at lookup)
        self._pending: deque[str] = deque(maxlen=1 << 16)
        self.dropped = 0  # entries dropped because their stored pieces left
        store.subscribe(self._heard)
        self.path = Path(path) if path is not None else None
        self._spec, self._embedder = (embedder, None) if isinstance(embedder, str) else (None, embedder)
        if self._spec is not None:
            from kvmem.embed import parse_method

            parse_method(self._spec)  # an unknown method fails here, not at the first prompt
        self._clear()
        self._loaded: dict | None = None  # the binding of an index read from `path`, checked at first use
        if self.path is not None and (self.path.exists() or self._entries_path.exists()):
            self._load()

    # -- state -------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.vectors = None  # a kvmem.embed.index.VectorIndex, made at the first remembered prompt
        self._ids: dict[int, np.ndarray] = {}  # vector key -> token ids, least recently used first
        self._by_digest: dict[bytes, int] = {}
        self._pieces: tuple[str, dict[str, set[int]]] | None = None  # (namespace, piece key -> entries), built lazily
        self._next = 0
        self.binding: dict | None = None  # {"tokenizer": ..., "embedder": ...} of the prompts held

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"SemanticIndex({len(self)} prompts, embedder={self._embedder_name()}, store={self.store!r})"

    @property
    def _entries_path(self) -> Path:
        return self.path.with_name(self.path.name + ".entries.json")

    def _embedder_name(self, lm=None) -> str:
        from kvmem.embed import LMEmbedder, is_lm_method

        if self._spec is not None:
            name, llm = self._spec, is_lm_method(self._spec)
        else:
            name, llm = getattr(self._embedder, "name", type(self._embedder).__name__), isinstance(self._embedder, LMEmbedder)
        return f"{name}@{lm.fingerprint}" if llm and lm is not None else name

    def _bind(self, lm) -> None:
        """Tie the index to this model's tokenizer and embedder; a loaded index made with others is dropped."""
        want = {"tokenizer": lm.tokenizer_id, "embedder": self._embedder_name(lm)}
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            if loaded != want:
                what = [f"{k} {loaded.get(k)!r}, expected {v!r}" for k, v in want.items() if loaded.get(k) != v]
                warnings.warn(f"kvmem semantic index {str(self.path)!r} was built with another {'; '.join(what)}; "
                              "starting empty", IndexWarning, stacklevel=3)
                self._clear()
        if self.binding is None:
            self.binding = want
        elif self.binding != want:
            raise KVMemError(f"this semantic index holds prompts of tokenizer/embedder {self.binding}; got {want} "
                             "(use one index per model)")

    def embedder(self, lm):
        if self._embedder is None:
            from kvmem.embed import get_embedder, is_lm_method

            self._embedder = get_embedder(self._spec, model=lm if is_lm_method(self._spec) else None)
        return self._embedder

    def embed(self, lm, ids: list[int], text: str | None = None) -> np.ndarray | None:
        """The normalised embedding of a prompt (its leading `embed_tokens` decoded, unless `text` is given), or
        None when there is no text to embed (e.g. only special tokens)."""
        if text is None:
            head = list(ids)[:self.embed_tokens] if self.embed_tokens else list(ids)
            text = lm.tokenizer.decode(head, skip_special_tokens=True)
        if not isinstance(text, str) or not text.strip():
            return None
        vec = np.asarray(self.embedder(lm).encode(text, normalize_embeddings=True), dtype=np.float32).reshape(-1)
        return vec if vec.size and np.isfinite(vec).all() else None

    # -- remember, look up -------------------------------------------------------------------------------
    def remember(self, lm, ids: list[int], cache: KVCache, text: str | None = None, vector: np.ndarray | None = None,
                 save_chunks: bool = True, compute_s: float | None = None, store: ChunkStore | None = None) -> str:
        """Store the KV of prompt `ids` that `cache` holds (right after its prefill: nothing decoded, nothing
        evicted) and add the prompt to the index. Saves its tail (the partial last chunk) and, with `save_chunks`,
        every full chunk whose rows the cache still holds in full (a sliding layer keeps only its last window:
        `prefill` / `prefill_semantic` store chunks as they are computed and pass save_chunks=False). Returns the
        prompt's key. `store`: a policy view of the index's store to write through (the server's `fill_store`)."""
        ids = check_ids(lm, ids)
        with self._lock:
            self._bind(lm)
            return self._remember(lm, ids, cache, text, vector, save_chunks, compute_s, store or self.store)

    def _remember(self, lm, ids, cache, text, vector, save_chunks, compute_s, store) -> str:
        check_plain(cache)
        if any(not layer.is_initialized or layer.next_position != len(ids) or layer.compressed
               or layer.log_weights is not None for layer in cache.layers):
            raise KVMemError(f"the cache does not hold exactly the {len(ids)} prompt tokens, unevicted (remember a "
                             "prompt right after its prefill)")
        n, windows = store.chunk_size, layer_windows(lm.config)
        if save_chunks:
            for j, ck in enumerate(store.keys(lm, ids)):
                rows = chunk_rows(cache, j * n, (j + 1) * n)
                if complete(rows, windows, j * n, (j + 1) * n):
                    store.save(lm, ck, rows, j * n, n)
        key = prompt_key(store, lm, ids)
        start = len(ids) // n * n
        if start < len(ids):
            rows = chunk_rows(cache, start, len(ids))
            if not complete(rows, windows, start, len(ids)):  # cannot happen for a plain, just prefilled cache
                raise KVMemError("the cache lacks rows of the prompt's last tokens")
            if not store.save(lm, key, rows, start, len(ids) - start, compute_s=compute_s):
                return key  # the tail was not stored (no tier took it, or a read-only view): nothing to remember
        arr = np.asarray(ids, dtype=np.int64)
        digest = _ids_digest(arr)
        if digest in self._by_digest:
            self._touch(self._by_digest[digest])
            return key
        if vector is None:
            vector = self.embed(lm, ids, text)
        if vector is None:
            return key  # nothing to embed: its chunks and tail are stored, the index cannot find it
        if self.vectors is None:
            from kvmem.embed.index import VectorIndex

            self.vectors = VectorIndex(len(vector), "float32", exact=True)
        vid = self._next
        self.vectors.add(np.array([vid]), vector[None])
        self._ids[vid], self._by_digest[digest], self._next = arr, vid, vid + 1
        if self._pieces is not None:
            for piece in self.piece_keys(lm, arr):
                self._pieces[1].setdefault(piece, set()).add(vid)
        while len(self._ids) > self.max_entries:  # the least recently used leaves
            self._drop(next(iter(self._ids)))
        self._check_pending(lm)  # what this prompt's writes evicted
        return key

    # -- entries leave with their pieces ---------------------------------------------------------------
    def _heard(self, key: str) -> None:
        if self._ids:  # nothing to drop while the index is empty
            self._pending.append(key)

    def piece_keys(self, lm, ids) -> list[str]:
        """The store keys of a remembered prompt's pieces: its full chunks and, if its length is not a whole number
        of chunks, its tail."""
        ids = [int(i) for i in ids]
        keys = chunk_keys(ids, self.store.chunk_size, self.store.namespace(lm))
        return keys + ([prompt_key(self.store, lm, ids)] if len(ids) % self.store.chunk_size else [])

    def _touch(self, vid: int) -> None:
        self._ids[vid] = self._ids.pop(vid)  # most recently used last

    def _drop(self, vid: int) -> None:
        ids = self._ids.pop(vid)
        self._by_digest.pop(_ids_digest(ids), None)
        self.vectors.remove(np.array([vid]))
        if self._pieces is not None:
            for vids in self._pieces[1].values():
                vids.discard(vid)

    def _piece_map(self, lm) -> dict[str, set[int]]:
        ns = self.store.namespace(lm)
        if self._pieces is None or self._pieces[0] != ns:
            pieces: dict[str, set[int]] = {}
            for vid, ids in self._ids.items():
                for piece in self.piece_keys(lm, ids):
                    pieces.setdefault(piece, set()).add(vid)
            self._pieces = (ns, pieces)
        return self._pieces[1]

    def _check_pending(self, lm) -> int:
        """Drop the entries with a piece the store reported gone that no tier holds any more; returns how many."""
        if not self._pending:
            return 0
        with self._lock:
            pieces, dropped = self._piece_map(lm), 0
            while self._pending:
                key = self._pending.popleft()
                vids = pieces.get(key)
                if vids and self.store.held(key) is False:
                    for vid in list(vids):
                        if vid in self._ids:
                            self._drop(vid)
                            dropped += 1
                    pieces.pop(key, None)
            self.dropped += dropped
            return dropped

    def piece_missing(self, lm, key: str) -> int:
        """A piece of a proposed prompt could not be loaded (a miss, or it failed verification): drop the entries that
        need it if no tier holds it (a tier that cannot be asked keeps them)."""
        self._pending.append(key)
        return self._check_pending(lm)

    def prune(self, lm) -> int:
        """Check every entry's pieces in the store (one existence check each) and drop the entries missing one, however
        they left (a Redis TTL, files deleted by another process); returns how many were dropped."""
        with self._lock:
            self._bind(lm)
            gone = [vid for vid, ids in self._ids.items()
                    if any(self.store.held(piece) is False for piece in self.piece_keys(lm, ids))]
            for vid in gone:
                self._drop(vid)
            self.dropped += len(gone)
            return len(gone)

    def forget(self, lm, ids: list[int]) -> bool:
        """Remove a prompt from the index (its stored pieces stay until the store evicts them)."""
        with self._lock:
            vid = self._by_digest.get(_ids_digest(np.asarray(list(ids), dtype=np.int64)))
            if vid is None:
                return False
            self._drop(vid)
            return True

    def used(self, ids) -> None:
        """A proposed prompt was reused: it becomes the most recently used (the last to leave at `max_entries`)."""
        with self._lock:
            vid = self._by_digest.get(_ids_digest(np.asarray(list(ids), dtype=np.int64)))
            if vid is not None:
                self._touch(vid)

    def candidates(self, lm, ids: list[int], k: int = 4, text: str | None = None,
                   vector: np.ndarray | None = None) -> list[Match]:
        """The k remembered prompts nearest to `ids` by embedding, each with its verified common token prefix,
        longest prefix first (then the higher similarity)."""
        ids = check_ids(lm, ids)
        if not isinstance(k, int) or k < 1:
            raise KVMemError(f"k must be a positive integer, got {k!r}")
        with self._lock:
            self._bind(lm)
            self._check_pending(lm)
            if not self._ids:
                return []
            if vector is None:
                vector = self.embed(lm, ids, text)
            if vector is None:
                return []
            if len(vector) != self.vectors.dim:
                raise KVMemError(f"a {len(vector)}-d embedding for a {self.vectors.dim}-d index")
            keys, scores = self.vectors.search(vector, min(k, len(self._ids)))
            query = np.asarray(ids, dtype=np.int64)
            out = [Match(prompt_key(self.store, lm, self._ids[int(v)].tolist()), common_prefix(query, self._ids[int(v)]),
                         float(s), self._ids[int(v)]) for v, s in zip(keys[0], scores[0]) if int(v) in self._ids]
        return sorted(out, key=lambda m: (-m.common, -m.score))

    def lookup(self, lm, ids: list[int], k: int = 4, text: str | None = None) -> tuple[str | None, int]:
        """(key, common prefix length) of the best verified candidate among the k nearest; (None, 0) if none
        shares a token."""
        found = self.candidates(lm, ids, k, text)
        return (found[0].key, found[0].common) if found and found[0].common else (None, 0)

    def scan(self, ids: list[int]) -> int:
        """The longest common prefix of `ids` with *any* remembered prompt (exhaustive, no embedding): what a
        perfect retriever would find (the benchmark's oracle)."""
        query = np.asarray(list(ids), dtype=np.int64)
        return max((common_prefix(query, e) for e in self._ids.values()), default=0)

    # -- persistence ---------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> Path:
        """Write the vector index to `path` and the token ids beside it (see the module doc); returns the path."""
        path = Path(path) if path is not None else self.path
        if path is None:
            raise KVMemError("no path to save the semantic index to: pass one here or to SemanticIndex(path=...)")
        self.path = path
        if self.vectors is not None:
            self.vectors.save(path)
            index_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            path.unlink(missing_ok=True)
            index_sha = None
        body = {"format": ENTRIES_FORMAT, "binding": self.binding, "dim": None if self.vectors is None else self.vectors.dim,
                "index_sha256": index_sha, "next": self._next,
                "entries": [[vid, ids.tolist()] for vid, ids in sorted(self._ids.items())]}
        text = json.dumps(body, sort_keys=True)
        blob = json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "body": text}).encode()
        tmp = self._entries_path.with_name(self._entries_path.name + ".tmp")
        try:
            tmp.write_bytes(blob)
            os.replace(tmp, self._entries_path)
        except OSError as e:
            raise KVMemError(f"cannot write semantic index entries {str(self._entries_path)!r} ({e.strerror})") from None
        return path

    def _load(self) -> None:
        try:
            self._read()
        except KVMemError as e:
            warnings.warn(f"kvmem semantic index {str(self.path)!r} not used ({e}); starting empty", IndexWarning,
                          stacklevel=3)
            self._clear()
            self._loaded = None

    def _read(self) -> None:
        from kvmem.embed.index import VectorIndex

        try:
            outer = json.loads(self._entries_path.read_bytes())
            text = outer["body"]
            if hashlib.sha256(text.encode()).hexdigest() != outer["sha256"]:
                raise KVMemError("the entries file's checksum does not match")
            body = json.loads(text)
            fmt, binding, dim, index_sha, nxt = (body["format"], body["binding"], body["dim"], body["index_sha256"],
                                                 int(body["next"]))
            entries = {int(vid): np.asarray(ids, dtype=np.int64) for vid, ids in body["entries"]}
        except KVMemError:
            raise
        except FileNotFoundError:
            raise KVMemError("its entries file (token ids) is missing") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KVMemError(f"the entries file is corrupt ({type(e).__name__})") from None
        if fmt != ENTRIES_FORMAT:
            raise KVMemError(f"entries format {fmt!r}, this kvmem reads {ENTRIES_FORMAT}")
        if binding is not None and (not isinstance(binding, dict) or binding.get("embedder", "").split("@")[0]
                                    != self._embedder_name().split("@")[0]):
            raise KVMemError(f"built with embedder {binding.get('embedder') if isinstance(binding, dict) else binding!r}, "
                             f"this index uses {self._embedder_name()!r}")
        vectors = None
        if index_sha is not None:
            try:
                data = self.path.read_bytes()
            except OSError as e:
                raise KVMemError(f"cannot read the vector index ({e.strerror})") from None
            if hashlib.sha256(data).hexdigest() != index_sha:
                raise KVMemError("the vector index file is not the one the entries were saved with")
            vectors = VectorIndex.load(self.path, dim=dim, precision="float32")
        if (entries and vectors is None) or (vectors is not None and (len(vectors) != len(entries) or not all(
                vid in vectors for vid in entries))) or any(vid >= nxt or vid < 0 for vid in entries):
            raise KVMemError("the vector index and the entries disagree")
        if any(e.ndim != 1 or not e.size for e in entries.values()):
            raise KVMemError("an entry holds no token ids")
        self.vectors, self._ids, self._next, self._pieces = vectors, entries, nxt, None
        self._by_digest = {_ids_digest(e): vid for vid, e in entries.items()}
        self._loaded = binding  # checked against the model at first use (`_bind`)


def check_ids(lm, ids) -> list[int]:
    ids = [int(i) for i in ids]
    if not ids:
        raise KVMemError("nothing to look up or remember: empty token list")
    if len(ids) > lm.max_context:
        raise KVMemError(f"context too long: {len(ids)} tokens > {lm.max_context} that {lm.name} allows")
    return ids


def complete(layers: list[ExportedRows], windows: list[int | None], start: int, end: int) -> bool:
    """Every layer holds exactly the rows of [start, end) an uncompressed layer holds right after computing them."""
    for rows, window in zip(layers, windows):
        want = expected_positions(window, start, end)
        for head in rows.heads:
            p = head["positions"]
            if p.numel() != len(want) or (p.numel() and not torch.equal(p, torch.arange(want.start, want.stop, dtype=p.dtype))):
                return False
    return True

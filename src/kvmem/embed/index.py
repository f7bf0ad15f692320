"""A vector index for maximum-inner-product search (MIPS) over kvmem embeddings, built on USearch.

Why USearch (`usearch` on PyPI, Apache-2.0): a 2.3 MB wheel (plus its 10.6 MB `numkong` SIMD kernels; faiss-cpu
is 18.8 MB) whose index stores our three precisions natively (f32, i8, b1 with inner-product and Hamming
metrics), answers exact (brute-force) and approximate (HNSW) queries from the same index, removes keys and
serializes to a buffer; it is released about monthly. faiss-cpu cannot remove from an HNSW index; hnswlib is
float-only, ships no wheels (a compiler is needed) and has had no release since 2023.

What `VectorIndex` guarantees:
- Scores: higher = more similar. float32: the inner product q . d; int8: the integer dot product of the codes
  (`int8_scores`); binary: the number of equal bits out of 8 * ceil(dim / 8) (`hamming_scores`). USearch returns
  float32 distances, so integer scores are exact while below 2**24 (for int8: dim <= 1040).
- `exact=True`: brute force, the top-k of numpy on the same codes (ties aside). `exact=False`: HNSW (USearch's
  defaults: connectivity 16, expansion 128 on add and 64 on search), approximate.
- int8 scales are fixed once, by `calibrate(vectors)` before the first add or else on the first `add`'s vectors
  (scale_d = max|x_d| / 127, `int8_scales`); later vectors and queries are quantized with those scales and clipped
  to [-127, 127], i.e. the codes of `quantize_embeddings(x, "int8", calibration)`. The scales are saved.
- Keys are unique non-negative integers. `search` caps k at len(index), so an empty index returns (nq, 0) arrays.
- `save` writes a JSON header (dim, precision, count, lengths, SHA-256 of the payload) then the payload; `load`
  checks all of it and raises KVMemError naming the file and the problem, never a USearch error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from usearch.index import Index

from kvmem.embed.base import PRECISIONS, _check_precision, int8_scales
from kvmem.errors import KVMemError

_MAGIC = b"KVMEMIDX"
_FORMAT = 1
_USEARCH = {"float32": ("f32", "ip"), "int8": ("i8", "ip"), "binary": ("b1", "hamming")}


class VectorIndex:
    """Keys -> embeddings of one precision; `search` returns the k keys of highest score (see the module doc)."""

    def __init__(self, dim: int, precision: str = "float32", exact: bool = True):
        _check_precision(precision)
        if not isinstance(dim, (int, np.integer)) or dim < 1:
            raise KVMemError(f"index dimension must be a positive integer, got {dim!r}")
        self.dim, self.precision, self.exact = int(dim), precision, bool(exact)
        self.scales: np.ndarray | None = None  # int8 only: float32 (dim,)
        self._bits = 8 * ((self.dim + 7) // 8)  # binary: packbits pads to whole bytes
        dtype, metric = _USEARCH[precision]
        self._index = Index(ndim=self._bits if precision == "binary" else self.dim, metric=metric, dtype=dtype)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (int, np.integer)) and key >= 0 and bool(self._index.contains(int(key)))

    def __repr__(self) -> str:
        return f"VectorIndex(dim={self.dim}, precision={self.precision!r}, exact={self.exact}, len={len(self)})"

    @property
    def bytes(self) -> int:
        """Serialized size of what the index holds: USearch's vectors + graph + its header, plus int8 scales."""
        return self._index.serialized_length + (0 if self.scales is None else self.scales.nbytes)

    def calibrate(self, vectors: np.ndarray) -> None:
        """int8 only: fix the per-dimension scales from float32 embeddings (before anything is added)."""
        if self.precision != "int8":
            raise KVMemError(f"calibrate is for int8 indexes; this one is {self.precision}")
        if len(self):
            raise KVMemError("calibrate before adding vectors: the stored int8 codes use the current scales")
        self.scales = int8_scales(self._check(vectors, "calibration vectors"))

    def _check(self, x: np.ndarray, what: str) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise KVMemError(f"{what} must have shape (n, {self.dim}), got {x.shape}")
        if not np.issubdtype(x.dtype, np.number) or not np.isfinite(x).all():
            raise KVMemError(f"{what} must be finite numbers (got NaN/inf or a non-numeric dtype {x.dtype})")
        return x.astype(np.float32, copy=False)

    def _encode(self, x: np.ndarray) -> np.ndarray:
        if self.precision == "binary":
            return np.packbits(x > 0, axis=-1)
        if self.precision == "int8":
            return np.clip(np.rint(x / self.scales), -127, 127).astype(np.int8)
        return x

    def _keys(self, keys: np.ndarray) -> np.ndarray:
        keys = np.atleast_1d(np.asarray(keys))
        if keys.ndim != 1 or (keys.size and not np.issubdtype(keys.dtype, np.integer)):
            raise KVMemError(f"keys must be a 1-D array of integers, got dtype {keys.dtype} shape {keys.shape}")
        if keys.size and keys.min() < 0:
            raise KVMemError(f"keys must be non-negative, got {int(keys.min())}")
        return keys.astype(np.uint64)

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Add float32 embeddings (n, dim) under new unique keys (n,); int8 calibrates here if not yet done."""
        keys, x = self._keys(keys), self._check(vectors, "vectors")
        if len(keys) != len(x):
            raise KVMemError(f"got {len(keys)} keys for {len(x)} vectors")
        if not len(keys):
            return
        if len(np.unique(keys)) != len(keys):
            raise KVMemError("duplicate keys within the added batch")
        present = np.atleast_1d(self._index.contains(keys))
        if present.any():
            raise KVMemError(f"keys already in the index: {keys[present][:10].astype(np.int64).tolist()}")
        if self.precision == "int8" and self.scales is None:
            self.scales = int8_scales(x)
        self._index.add(keys, self._encode(x))

    def remove(self, keys: np.ndarray) -> None:
        """Remove keys (all must be present; nothing is removed otherwise)."""
        keys = self._keys(keys)
        missing = ~np.atleast_1d(self._index.contains(keys)) if len(keys) else np.zeros(0, bool)
        if missing.any():
            raise KVMemError(f"keys not in the index: {keys[missing][:10].astype(np.int64).tolist()}")
        if len(keys):
            self._index.remove(keys)

    def search(self, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        """Top-k of float32 queries (nq, dim) or (dim,) -> keys int64 (nq, k'), scores float32 (nq, k'), best
        first, k' = min(k, len(index)); an approximate row short of hits is padded with key -1, score -inf."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            raise KVMemError(f"k must be a positive integer, got {k!r}")
        q = self._check(np.atleast_2d(queries), "queries")
        k = min(int(k), len(self))
        keys, scores = np.full((len(q), k), -1, np.int64), np.full((len(q), k), -np.inf, np.float32)
        if k == 0 or not len(q):
            return keys, scores
        m = self._index.search(self._encode(q), k, exact=self.exact)  # one query: Matches, without padding
        got, dist = np.asarray(m.keys).reshape(len(q), -1), np.asarray(m.distances, np.float32).reshape(len(q), -1)
        found = np.arange(got.shape[1])[None, :] < np.asarray(getattr(m, "counts", got.shape[1])).reshape(-1, 1)
        keys[:, :got.shape[1]][found] = got[found].astype(np.int64)
        scores[:, :got.shape[1]][found] = (self._bits - dist if self.precision == "binary" else 1.0 - dist)[found]
        return keys, scores

    def save(self, path: str | os.PathLike) -> None:
        """Write header + payload (int8 scales, then USearch's serialized index) to `path` (atomically)."""
        scales = b"" if self.scales is None else self.scales.astype("<f4").tobytes()
        payload = scales + bytes(self._index.save())
        header = json.dumps({"format": _FORMAT, "dim": self.dim, "precision": self.precision, "exact": self.exact,
                             "count": len(self), "scales_bytes": len(scales), "payload_bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(_MAGIC + len(header).to_bytes(4, "little") + header + payload)
            os.replace(tmp, path)
        except OSError as e:
            raise KVMemError(f"cannot write vector index file {str(path)!r} ({e.strerror})") from None

    @classmethod
    def load(cls, path: str | os.PathLike, dim: int | None = None, precision: str | None = None) -> "VectorIndex":
        """Read and verify an index written by `save`; `dim` / `precision`, if given, must match the file."""
        def fail(problem: str) -> KVMemError:
            return KVMemError(f"vector index file {str(path)!r}: {problem}")

        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise fail(f"cannot read it ({e.strerror})") from None
        if data[:len(_MAGIC)] != _MAGIC or len(data) < len(_MAGIC) + 4:
            raise fail("not a kvmem vector index (bad magic bytes)")
        start = len(_MAGIC) + 4 + int.from_bytes(data[len(_MAGIC):len(_MAGIC) + 4], "little")
        try:
            h = json.loads(data[len(_MAGIC) + 4:start])
            fmt, n_dim, prec, count, n_scales, n_payload, digest = (h["format"], int(h["dim"]), h["precision"],
                int(h["count"]), int(h["scales_bytes"]), int(h["payload_bytes"]), h["sha256"])
        except (ValueError, KeyError, TypeError):
            raise fail("corrupt or truncated header") from None
        if fmt != _FORMAT or prec not in PRECISIONS:
            raise fail(f"unsupported format {fmt!r} or precision {prec!r}")
        if len(data) - start != n_payload:
            raise fail(f"truncated or padded: header says {n_payload} payload bytes, found {len(data) - start}")
        payload = data[start:]
        if hashlib.sha256(payload).hexdigest() != digest:
            raise fail("checksum mismatch: the file is corrupt")
        if (dim is not None and dim != n_dim) or (precision is not None and precision != prec):
            raise fail(f"holds a {n_dim}-d {prec} index, expected {dim or n_dim}-d {precision or prec}")
        out = cls(n_dim, prec, bool(h.get("exact", True)))
        if n_scales != (4 * n_dim if prec == "int8" else 0):
            raise fail(f"{n_scales} bytes of int8 scales for a {n_dim}-d {prec} index")
        if n_scales:
            out.scales = np.frombuffer(payload[:n_scales], "<f4").astype(np.float32)
        try:
            index = Index.restore(payload[n_scales:])
        except (RuntimeError, ValueError) as e:
            raise fail(f"unreadable USearch data ({e})") from None
        if index is None or (index.ndim, index.dtype, index.metric_kind, len(index)) != (
                out._index.ndim, out._index.dtype, out._index.metric_kind, count):
            raise fail(f"USearch data does not match the header ({n_dim}-d {prec}, {count} vectors)")
        out._index = index
        return out

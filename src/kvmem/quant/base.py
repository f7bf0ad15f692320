"""Quantized row storage: the `Rows` contract (`kvmem.rows`) with keys and values held as packed codes.

A `Scheme` encodes blocks of `group` tokens of one head (keys and values) into `Quantized` tensors and
decodes them. `QuantizedRows` holds, per head, the encoded blocks joined into one packed tensor per K and
V, plus a full-precision residual: the newest `residual` rows and those that do not yet fill a block
(KIVI's recent window). The
layer calls `flush()` after each forward's attention, so the tokens of a forward are attended at full
precision by that forward (as in KIVI and transformers' QuantizedCache) and held packed afterwards.

Eviction composes: `keep()` on quantized rows decodes, selects and re-encodes the kept rows in new blocks
(the compressor runs before the flush, so in `prefill -> compress -> decode` the kept rows are encoded
once, from full precision). A sliding layer drops whole blocks only (`drop_prefix`); rows of a partly
expired block stay and the position mask hides them, so nothing is re-encoded as the window moves.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.rows import ExportedRows, Rows


class Encoded(Protocol):
    """One head's encoded rows (keys or values) as a scheme returns them: `Quantized` (pack.py) or a scheme's
    own composite (e.g. codes plus sparse outliers). Rows run along the first dimension of what it encodes."""

    @property
    def rows(self) -> int: ...

    def tensors(self) -> list[Tensor]: ...  # what is held, byte for byte

    def cat(self, later: Encoded) -> Encoded: ...  # these rows, then `later`'s

    def drop(self, n: int) -> Encoded: ...  # rows n: (n a multiple of the scheme's group)


def encoded_rows(heads: list[Encoded | None]) -> int:
    """How many encoded rows every head holds when they all hold as many (a decode in one pass), else 0."""
    rows = {q.rows if q is not None else 0 for q in heads}
    return rows.pop() if len(rows) == 1 else 0


class Scheme:
    """How one head's blocks of `group` tokens are encoded; subclasses implement `encode` and `decode`.

    A scheme fitted per model (`calibrated = True`: datatypes, codebooks, thresholds learned offline) is made
    usable by `prepare(lm)`, which loads or fits its artefacts; `for_layer(i)` gives the view one layer uses
    (its own datatype, codebook or RoPE frequencies). `encode` and `decode` get the KV head and the rows'
    original positions, so a scheme may fit per head and quantize keys before RoPE."""

    name: ClassVar[str]
    calibrated: ClassVar[bool] = False
    bits: float  # average bits per stored element, codes only (scales, zero-points and outliers add to it)
    group: int
    residual: int = 0  # the newest rows kept in full precision beyond the incomplete block (KIVI's R)

    def check(self, head_dim: int) -> None:
        """Raise a KVMemError if the scheme cannot hold heads of this size."""

    def prepare(self, lm) -> Scheme:
        """This scheme made ready for `lm` (fitted artefacts loaded or fitted, once, cached on disk)."""
        return self

    @property
    def ready(self) -> bool:
        return True

    def for_layer(self, layer: int) -> Scheme:
        return self

    def new_rows(self, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None) -> Rows:
        """Empty storage for one layer's rows held by this scheme (a scheme with its own layout overrides it)."""
        return QuantizedRows(self, heads, head_dim, dtype, device, value_dim)

    def rows_of(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> Rows:
        """Storage holding these rows per head (`KVLayer.import_rows`)."""
        return QuantizedRows.of(self, keys, values, positions)

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[Encoded, Encoded]:
        """KV head `head`'s keys, values (n, D) with n a multiple of `group`, at `positions` (n,) -> their
        encoded forms."""
        raise NotImplementedError

    def decode(self, keys: Encoded, values: Encoded, positions: Tensor, head: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def encode_heads(self, keys: Tensor, values: Tensor, positions: Tensor) -> list[tuple[Encoded, Encoded]]:
        """Every head's rows, keys and values (H, n, D) at positions (H, n), encoded: head by head here; a scheme
        that can encode all heads in one pass overrides it (a decode step encodes one row per head per layer)."""
        return [self.encode(k, v, p, h) for h, (k, v, p) in enumerate(zip(keys, values, positions))]

    def decode_heads(self, keys: list[Encoded | None], values: list[Encoded | None], positions: list[Tensor],
                     out_keys: Tensor, out_values: Tensor) -> None:
        """Every head's encoded rows decoded into `out_keys[h, :n_h]` / `out_values[h, :n_h]` (the layer's stacked
        buffers; None: head h has no encoded rows). Head by head here; a scheme that can decode all heads in one
        pass overrides it (per-op overhead, not arithmetic, dominates a decode step on CPU)."""
        for h, (k, v, p) in enumerate(zip(keys, values, positions)):
            if k is not None:
                dk, dv = self.decode(k, v, p[:k.rows], h)
                out_keys[h, :k.rows].copy_(dk)
                out_values[h, :k.rows].copy_(dv)

    @property
    def spec(self) -> str:
        return self.name


class QuantizedRows(Rows):
    def __init__(self, scheme: Scheme, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None):
        self.scheme, self.dtype = scheme, dtype
        self.codec = scheme.spec
        empty = lambda d: torch.empty((0, d), dtype=dtype, device=device)  # noqa: E731
        self.qk: list[Encoded | None] = [None] * heads  # encoded rows, oldest first
        self.qv: list[Encoded | None] = [None] * heads
        self.rk = [empty(head_dim) for _ in range(heads)]  # residual rows, full precision, newest last
        self.rv = [empty(value_dim or head_dim) for _ in range(heads)]
        self.p = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(heads)]  # every row's position

    @classmethod
    def of(cls, scheme: Scheme, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> QuantizedRows:
        """These rows per head, encoded in blocks (the remainder stays in the residual)."""
        rows = cls(scheme, len(keys), keys[0].shape[-1], keys[0].dtype, keys[0].device, values[0].shape[-1])
        rows.rk, rows.rv, rows.p = [k.clone() for k in keys], [v.clone() for v in values], [p.clone() for p in positions]
        rows.flush()
        return rows

    def with_rows(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> QuantizedRows:
        return QuantizedRows.of(self.scheme, keys, values, positions)

    def lengths(self) -> list[int]:
        return [p.numel() for p in self.p]

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        out = []
        for h, (qk, qv, rk, rv, p) in enumerate(zip(self.qk, self.qv, self.rk, self.rv, self.p)):
            if qk is None:
                out.append((rk, rv, p))
                continue
            k, v = self.scheme.decode(qk, qv, p[:qk.rows], h)
            out.append((torch.cat([k, rk]), torch.cat([v, rv]), p))
        return out

    def stacked(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Every head decoded straight into one (H, T, D) buffer per K and V (no per-head copies to join):
        what a forward's attention reads. Freed after that forward; only the encoded rows are held."""
        lengths = self.lengths()
        if len(set(lengths)) != 1:
            return None
        rk, rv = self.rk[0], self.rv[0]
        keys = rk.new_empty((len(lengths), lengths[0], rk.shape[-1]))
        values = rv.new_empty((len(lengths), lengths[0], rv.shape[-1]))
        self.scheme.decode_heads(self.qk, self.qv, self.p, keys, values)
        for h, (qk, rk, rv) in enumerate(zip(self.qk, self.rk, self.rv)):
            n = qk.rows if qk is not None else 0
            keys[h, n:], values[h, n:] = rk, rv
        return keys, values, torch.stack(self.p)

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        for h in range(len(self.p)):
            self.rk[h] = torch.cat([self.rk[h], keys[h]])
            self.rv[h] = torch.cat([self.rv[h], values[h]])
            self.p[h] = torch.cat([self.p[h], positions])

    def flush(self) -> None:
        """Encode every full block of residual rows older than the scheme's `residual` newest rows."""
        g = self.scheme.group
        counts = [max(rk.shape[0] - self.scheme.residual, 0) // g * g for rk in self.rk]
        done = [q.rows if q is not None else 0 for q in self.qk]
        if len(set(counts)) == 1 and counts[0]:  # every head encodes as many rows: all in one pass
            n = counts[0]
            encoded = self.scheme.encode_heads(torch.stack([rk[:n] for rk in self.rk]), torch.stack([rv[:n] for rv in self.rv]),
                                               torch.stack([p[d:d + n] for p, d in zip(self.p, done)]))
        else:
            encoded = [self.scheme.encode(rk[:n], rv[:n], p[d:d + n], h) if n else None
                       for h, (rk, rv, p, n, d) in enumerate(zip(self.rk, self.rv, self.p, counts, done))]
        for h, (rk, rv, n, kv) in enumerate(zip(self.rk, self.rv, counts, encoded)):
            if not n:
                continue
            k, v = kv
            self.qk[h] = k if self.qk[h] is None else self.qk[h].cat(k)
            self.qv[h] = v if self.qv[h] is None else self.qv[h].cat(v)
            self.rk[h], self.rv[h] = rk[n:].clone(), rv[n:].clone()

    def keep(self, indices: list[Tensor]) -> QuantizedRows:
        heads = self.heads()
        return self.with_rows([k.index_select(0, i) for (k, _, _), i in zip(heads, indices)],
                              [v.index_select(0, i) for (_, v, _), i in zip(heads, indices)],
                              [p.index_select(0, i) for (_, _, p), i in zip(heads, indices)])

    def drop_prefix(self, counts: list[int]) -> None:
        """Drop the first `counts[h]` rows of each head where they fill whole encoded blocks; the others
        stay (their positions let the mask hide them)."""
        g = self.scheme.group
        for h, n in enumerate(counts):
            encoded = self.qk[h].rows if self.qk[h] is not None else 0
            blocks = min(n, encoded) // g * g
            if not blocks:
                continue
            self.qk[h] = self.qk[h].drop(blocks) if blocks < encoded else None
            self.qv[h] = self.qv[h].drop(blocks) if blocks < encoded else None
            self.p[h] = self.p[h][blocks:].clone()

    def kv_tensors(self) -> list[Tensor]:
        held = [t for q in (*self.qk, *self.qv) if q is not None for t in q.tensors()]
        return held + [t for t in (*self.rk, *self.rv)]

    def position_tensors(self) -> list[Tensor]:
        return list(self.p)

    def export_rows(self) -> ExportedRows:
        """The rows as held, not decoded: per head the encoded tensors (`k.*`, `v.*`), the full-precision residual
        and the positions; the codec is the scheme's spec, and what is not a tensor (bit widths, shapes, the
        encoded types) goes into `meta`. `import_encoded` rebuilds exactly these rows."""
        heads, head_meta = [], []
        for qk, qv, rk, rv, p in zip(self.qk, self.qv, self.rk, self.rv, self.p):
            tensors = {"positions": p.clone(), "residual_keys": rk.clone(), "residual_values": rv.clone()}
            meta: dict = {}
            for prefix, q in (("k", qk), ("v", qv)):
                if q is not None:
                    _flatten(q, prefix, tensors, meta)
            heads.append(tensors)
            head_meta.append(meta)
        return ExportedRows(heads, codec=self.codec, meta={"format": EXPORT_FORMAT, "dtype": str(self.dtype).split(".")[-1],
                                                           "heads": head_meta})

    @classmethod
    def import_encoded(cls, scheme: Scheme, rows: ExportedRows) -> QuantizedRows:
        """Rows exported by `export_rows` from a cache of the same scheme, checked (codec, format, types, lengths)."""
        if rows.codec != scheme.spec:
            raise KVMemError(f"rows are encoded as {rows.codec!r}; this layer holds {scheme.spec!r}")
        if rows.meta.get("format") != EXPORT_FORMAT or len(rows.meta.get("heads", ())) != len(rows.heads):
            raise KVMemError(f"encoded rows of an unknown format {rows.meta.get('format')!r} or without per-head metadata")
        dtype = getattr(torch, str(rows.meta.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise KVMemError(f"encoded rows name an unknown dtype {rows.meta.get('dtype')!r}")
        for h, tensors in enumerate(rows.heads):
            if missing := {"positions", "residual_keys", "residual_values"} - set(tensors):
                raise KVMemError(f"head {h} of the encoded rows lacks {sorted(missing)}")
        if not rows.heads:
            raise KVMemError("encoded rows hold no heads")
        first = rows.heads[0]
        out = cls(scheme, len(rows.heads), first["residual_keys"].shape[-1], dtype, first["positions"].device,
                  first["residual_values"].shape[-1])
        for h, (tensors, meta) in enumerate(zip(rows.heads, rows.meta["heads"])):
            qk, qv = (_unflatten(prefix, tensors, meta) if f"{prefix}.__type" in meta else None for prefix in ("k", "v"))
            p = tensors["positions"]
            if p.dtype != torch.int32 or p.dim() != 1 or (p.numel() > 1 and not bool((p[1:] > p[:-1]).all())):
                raise KVMemError(f"head {h}: positions must be int32 and increasing")
            n = p.numel()
            encoded = qk.rows if qk is not None else 0
            if (qv.rows if qv is not None else 0) != encoded or encoded + tensors["residual_keys"].shape[0] != n \
                    or tensors["residual_values"].shape[0] != n - encoded:
                raise KVMemError(f"head {h}: encoded and residual rows do not add up to its {n} positions")
            out.qk[h], out.qv[h] = qk, qv
            out.rk[h], out.rv[h], out.p[h] = tensors["residual_keys"], tensors["residual_values"], tensors["positions"]
        return out


EXPORT_FORMAT = 1


def _encoded_types() -> dict[str, type]:
    """The encoded row types an export may name (only these are ever rebuilt from stored metadata)."""
    from kvmem.quant.cq import Codes
    from kvmem.quant.kvquant import SparseCoded
    from kvmem.quant.pack import Quantized
    from kvmem.quant.rotatekv import WithSinks

    return {t.__name__: t for t in (Quantized, SparseCoded, WithSinks, Codes)}


def _flatten(obj, prefix: str, tensors: dict, meta: dict) -> None:
    """A dataclass of encoded rows as named tensors plus JSON-able metadata (nested dataclasses too)."""
    if type(obj).__name__ not in _encoded_types():
        raise KVMemError(f"{type(obj).__name__} rows cannot be exported")
    meta[f"{prefix}.__type"] = type(obj).__name__
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if isinstance(value, Tensor):
            tensors[key] = value.clone()
        elif dataclasses.is_dataclass(value):
            _flatten(value, key, tensors, meta)
        elif isinstance(value, torch.dtype):
            meta[key] = {"dtype": str(value).split(".")[-1]}
        else:
            meta[key] = list(value) if isinstance(value, tuple) else value


def _unflatten(prefix: str, tensors: dict, meta: dict):
    types = _encoded_types()
    cls = types.get(meta.get(f"{prefix}.__type"))
    if cls is None:
        raise KVMemError(f"encoded rows name an unknown type {meta.get(f'{prefix}.__type')!r}")
    values = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if key in tensors:
            values[f.name] = tensors[key]
        elif f"{key}.__type" in meta:
            values[f.name] = _unflatten(key, tensors, meta)
        elif key in meta:
            v = meta[key]
            if isinstance(v, dict) and "dtype" in v:
                v = getattr(torch, v["dtype"])
            values[f.name] = tuple(v) if isinstance(v, list) else v
        else:
            raise KVMemError(f"encoded rows lack {key!r}")
    return cls(**values)


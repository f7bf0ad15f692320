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

from typing import ClassVar

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.pack import Quantized, concat
from kvmem.rows import ExportedRows, Rows


class Scheme:
    """How one head's blocks of `group` tokens are encoded; subclasses implement `encode` and `decode`."""

    name: ClassVar[str]
    bits: int
    group: int
    residual: int = 0  # the newest rows kept in full precision beyond the incomplete block (KIVI's R)

    def check(self, head_dim: int) -> None:
        """Raise a KVMemError if the scheme cannot hold heads of this size."""

    def encode(self, keys: Tensor, values: Tensor) -> tuple[Quantized, Quantized]:
        """keys, values (n, D) with n a multiple of `group` -> their quantized forms (joinable along rows)."""
        raise NotImplementedError

    def decode(self, keys: Quantized, values: Quantized) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    @property
    def spec(self) -> str:
        return self.name


class QuantizedRows(Rows):
    def __init__(self, scheme: Scheme, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None):
        self.scheme, self.dtype = scheme, dtype
        self.codec = scheme.spec
        empty = lambda d: torch.empty((0, d), dtype=dtype, device=device)  # noqa: E731
        self.qk: list[Quantized | None] = [None] * heads  # encoded rows, oldest first
        self.qv: list[Quantized | None] = [None] * heads
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
        for qk, qv, rk, rv, p in zip(self.qk, self.qv, self.rk, self.rv, self.p):
            if qk is None:
                out.append((rk, rv, p))
                continue
            k, v = self.scheme.decode(qk, qv)
            out.append((torch.cat([k, rk]), torch.cat([v, rv]), p))
        return out

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        for h in range(len(self.p)):
            self.rk[h] = torch.cat([self.rk[h], keys[h]])
            self.rv[h] = torch.cat([self.rv[h], values[h]])
            self.p[h] = torch.cat([self.p[h], positions])

    def flush(self) -> None:
        """Encode every full block of residual rows older than the scheme's `residual` newest rows."""
        g = self.scheme.group
        for h, (rk, rv) in enumerate(zip(self.rk, self.rv)):
            n = max(rk.shape[0] - self.scheme.residual, 0) // g * g
            if not n:
                continue
            k, v = self.scheme.encode(rk[:n], rv[:n])
            self.qk[h] = k if self.qk[h] is None else concat([self.qk[h], k], 0)
            self.qv[h] = v if self.qv[h] is None else concat([self.qv[h], v], 0)
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
            encoded = self.qk[h].shape[0] if self.qk[h] is not None else 0
            blocks = min(n, encoded) // g * g
            if not blocks:
                continue
            self.qk[h] = _slice_rows(self.qk[h], blocks) if blocks < encoded else None
            self.qv[h] = _slice_rows(self.qv[h], blocks) if blocks < encoded else None
            self.p[h] = self.p[h][blocks:].clone()

    def kv_tensors(self) -> list[Tensor]:
        held = [t for q in (*self.qk, *self.qv) if q is not None for t in q.tensors()]
        return held + [t for t in (*self.rk, *self.rv)]

    def position_tensors(self) -> list[Tensor]:
        return list(self.p)

    def export_rows(self) -> ExportedRows:
        raise KVMemError(f"rows held as {self.codec} cannot be exported yet (the chunk store's quant codec comes "
                         "with it); decode them with a raw cache instead")


def _slice_rows(q: Quantized, start: int) -> Quantized:
    """Rows `start:` of a quantized (T, D) tensor; `start` a multiple of the group when groups run along rows."""
    scale_rows = (slice(None), slice(start // q.group, None)) if q.dim == 0 else (slice(start, None),)
    shape = (q.shape[0] - start, *q.shape[1:])
    return Quantized(q.packed[start:].clone(), q.scale[scale_rows].clone(), q.zero[scale_rows].clone(), q.bits,
                     q.group, q.dim, shape, q.dtype)

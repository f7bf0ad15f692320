"""Per-head row storage: what one cache layer holds for each KV head.

A row is one cached token of one KV head: its key, its value and its original position. Heads may hold
different rows (per-head budgets), so storage is per head. Every storage class keeps one contract:

* `append(keys, values, positions)`: the same new tokens for every head, in place;
* `keep(indices)`: a new storage holding exactly these rows per head (the old buffers are released);
* `heads()`: per head, full-precision (keys, values, positions) for attention and scorers (`positions()`: the
  positions alone, nothing decoded);
* `stacked()`: the same as (H, T, D) tensors when every head holds T rows (None otherwise), what a
  forward's attention reads;
* `kv_tensors()` / `position_tensors()`: what is held, for `kvmem.cache.storage_bytes`;
* `export_rows()` and `import_rows()`: rows in a portable form (per head tensors plus the codec's
  metadata), the unit the chunk store keeps;
* `kernel_rows()`, `kernel_key()`, `attend_kernel()`: what the decode kernel (`kvmem.kernel`) reads where a decode
  step attends the rows in place, several sequences in one call (`kvmem.attention.attend_in_place`).

Layouts, chosen by `store_rows`: `DenseRows` while all heads hold the same number of rows (one
buffer, read by attention without a copy), `RaggedRows` once they differ (one exact buffer per head:
evicted rows are really gone), and `PaddedRows` for short rows of different lengths (a quantized layer's
residual: one buffer, one write a decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvmem.errors import KVMemError

GROW = 64  # free rows added when a buffer fills: appends stay amortized, spare capacity stays small


@dataclass
class ExportedRows:
    """One layer's rows, portable: per head a dict of tensors (`keys` (T, D), `values` (T, D), `positions`
    (T,) int32 increasing, and what the codec adds), plus the codec's name and metadata."""

    heads: list[dict[str, Tensor]]
    codec: str = "raw"  # raw: keys and values in the model's dtype
    meta: dict = field(default_factory=dict)

    def lengths(self) -> list[int]:
        return [int(h["positions"].numel()) for h in self.heads]


class DenseExport(ExportedRows):
    """Raw rows of a layer whose heads hold as many rows, kept as one (H, T, D) tensor per keys and values and (H, T)
    positions: a stored chunk's layer as the store decodes it (`kvmem.store.codecs`). The store checks and the prefix
    loader imports these three tensors layer by layer; `heads` (views, as every other consumer reads rows) is made on
    first use only. Why: a loaded SmolLM2 chunk held 694 objects tracked by the garbage collector head by head (214 as
    these), and at 8k they brought on a full collection of the benchmark's process (0.2 s) inside the load. The
    shapes are what the caller says they are: `kvmem.store.store` checks them before anything reads a head."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor):
        self.keys, self.values, self.positions = keys, values, positions
        self.codec, self.meta = "raw", {}
        self._heads: list[dict[str, Tensor]] | None = None

    @property
    def heads(self) -> list[dict[str, Tensor]]:  # type: ignore[override]
        if self._heads is None:
            self._heads = [{"keys": k, "values": v, "positions": p}
                           for k, v, p in zip(self.keys.unbind(0), self.values.unbind(0), self.positions.unbind(0))]
        return self._heads

    def lengths(self) -> list[int]:
        return [int(self.positions.shape[1])] * int(self.positions.shape[0])


class KernelRows(NamedTuple):
    """What the decode kernel reads of one sequence's layer: its KV heads' encoded rows joined along rows (head h's
    at offsets[h]:offsets[h + 1]; None where nothing is encoded) and each head's full-precision rows, all views."""

    keys: Any
    values: Any
    offsets: Tensor | None
    residual_keys: list[Tensor]
    residual_values: list[Tensor]
    residual_rows: list[int] | None = None  # rows read of each head's residual buffers (None: all of them)


class Rows:
    """The storage contract (see the module doc)."""

    codec = "raw"

    def lengths(self) -> list[int]:
        raise NotImplementedError

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        raise NotImplementedError

    def positions(self) -> list[Tensor]:
        """Per head the rows' positions (nothing decoded)."""
        return [p for _, _, p in self.heads()]

    def stacked(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(H, T, D) keys and values and (H, T) positions when every head holds T rows, else None."""
        if len(set(self.lengths())) != 1:
            return None
        return tuple(map(torch.stack, zip(*self.heads())))

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Add `keys`/`values` (H, Q, D) at `positions` (Q,) to every head."""
        raise NotImplementedError

    def with_rows(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> Rows:
        """A storage of this kind holding exactly these rows per head."""
        return store_rows(keys, values, positions)

    def keep(self, indices: list[Tensor]) -> Rows:
        """A storage with the rows at `indices[h]` (increasing) of each head."""
        heads = self.heads()
        return self.with_rows([k.index_select(0, i) for (k, _, _), i in zip(heads, indices)],
                          [v.index_select(0, i) for (_, v, _), i in zip(heads, indices)],
                          [p.index_select(0, i) for (_, _, p), i in zip(heads, indices)])

    def kv_tensors(self) -> list[Tensor]:
        raise NotImplementedError

    def position_tensors(self) -> list[Tensor]:
        raise NotImplementedError

    @property
    def num_heads(self) -> int:
        return len(self.lengths())

    def export_rows(self) -> ExportedRows:
        return ExportedRows([{"keys": k.clone(), "values": v.clone(), "positions": p.clone()} for k, v, p in self.heads()])

    # -- a decode step read in place by the kernel (full precision here; quantized rows override) --
    def kernel_key(self) -> tuple:
        """Rows with equal keys share one kernel call."""
        return ("float32",)

    def kernel_rows(self) -> KernelRows:
        return KernelRows(None, None, None, *self.kernel_heads())

    def kernel_heads(self) -> tuple[list[Tensor], list[Tensor], list[int]]:
        """Per head its keys' and values' buffers as the decode kernel reads them (they may hold spare rows past the
        head's) and how many rows each holds."""
        heads = self.heads()
        return [k for k, _, _ in heads], [v for _, v, _ in heads], self.lengths()

    def attend_kernel(self, query: Tensor, rows: list[KernelRows], scaling: float) -> Tensor:
        """query (B, Hq, D) over B sequences' `kernel_rows` of this kind: (B, Hq, D)."""
        from kvmem import kernel

        return kernel.decode_attention(query, rows, scaling)


class _OneBuffer(Rows):
    """Heads kept in one (H, capacity, D) buffer per keys and values and (H, capacity) positions (`k`, `v`, `p`)."""

    k: Tensor
    v: Tensor
    p: Tensor

    def kernel_heads(self) -> tuple[list[Tensor], list[Tensor], list[int]]:
        return (*_head_buffers(self), self.lengths())

    def kv_tensors(self) -> list[Tensor]:
        return [self.k, self.v]

    def position_tensors(self) -> list[Tensor]:
        return [self.p]


class DenseRows(_OneBuffer):
    """All heads equally long: keys and values in one (H, capacity, D) buffer, positions (H, capacity)."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor, n: int, grow: int = GROW):
        self.k, self.v, self.p, self.n = keys, values, positions, n
        self.grow = grow  # free rows added when the buffer fills

    def lengths(self) -> list[int]:
        return [self.n] * self.k.shape[0]

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return [(self.k[h, :self.n], self.v[h, :self.n], self.p[h, :self.n]) for h in range(self.k.shape[0])]

    def live(self) -> tuple[Tensor, Tensor, Tensor]:
        """(H, T, D) keys and values and (H, T) positions, views of the buffers."""
        return self.k[:, :self.n], self.v[:, :self.n], self.p[:, :self.n]

    stacked = live

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        q = keys.shape[1]
        if self.n + q > self.k.shape[1]:
            spare = q + (self.grow if self.n else 0)  # a prefill into an empty layer is stored exactly
            k, v, p = self.live()
            self.k = torch.cat([k, k.new_empty((k.shape[0], spare, k.shape[2]))], dim=1)
            self.v = torch.cat([v, v.new_empty((v.shape[0], spare, v.shape[2]))], dim=1)
            self.p = torch.cat([p, p.new_empty((p.shape[0], spare))], dim=1)
        self.k[:, self.n:self.n + q], self.v[:, self.n:self.n + q], self.p[:, self.n:self.n + q] = keys, values, positions
        self.n += q


class RaggedRows(Rows):
    """Heads of different lengths: one buffer per head, sized to its rows (plus growth room once decoding)."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor], n: list[int], grow: int = GROW):
        self.k, self.v, self.p, self.n = keys, values, positions, n
        self.grow = grow

    def lengths(self) -> list[int]:
        return list(self.n)

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return [(k[:n], v[:n], p[:n]) for k, v, p, n in zip(self.k, self.v, self.p, self.n)]

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        q = keys.shape[1]
        for h, n in enumerate(self.n):
            if n + q > self.k[h].shape[0]:
                grow = lambda t: torch.cat([t[:n], t.new_empty((q + self.grow, *t.shape[1:]))])  # noqa: E731
                self.k[h], self.v[h], self.p[h] = grow(self.k[h]), grow(self.v[h]), grow(self.p[h])
            self.k[h][n:n + q], self.v[h][n:n + q], self.p[h][n:n + q] = keys[h], values[h], positions
            self.n[h] = n + q

    def kv_tensors(self) -> list[Tensor]:
        return [*self.k, *self.v]

    def position_tensors(self) -> list[Tensor]:
        return list(self.p)


class PaddedRows(_OneBuffer):
    """Heads of different but short lengths (a quantized layer's full-precision residual: under a block or two
    each) in one (H, capacity, D) buffer: a decode step appends to every head in one indexed write, where
    `RaggedRows` writes head by head. The padding (capacity past a head's rows) is held, and counted."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor], grow: int = GROW):
        self.n = [k.shape[0] for k in keys]
        cap = max(self.n) + grow
        self.k = keys[0].new_empty((len(keys), cap, keys[0].shape[-1]))
        self.v = values[0].new_empty((len(values), cap, values[0].shape[-1]))
        self.p = positions[0].new_empty((len(positions), cap))
        for h, (k, v, p, n) in enumerate(zip(keys, values, positions, self.n)):
            self.k[h, :n], self.v[h, :n], self.p[h, :n] = k, v, p
        self.grow = grow
        self._next: Tensor | None = None  # `append`'s write index, made when first needed

    def lengths(self) -> list[int]:
        return list(self.n)

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        return [(self.k[h, :n], self.v[h, :n], self.p[h, :n]) for h, n in enumerate(self.n)]

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        heads, q = keys.shape[:2]
        if max(self.n) + q > self.k.shape[1]:
            spare = q + self.grow
            grow = lambda t: torch.cat([t, t.new_empty((t.shape[0], spare, *t.shape[2:]))], dim=1)  # noqa: E731
            self.k, self.v, self.p = grow(self.k), grow(self.v), grow(self.p)
            self._next = None
        if self._next is None:  # each head's next free row in the buffers seen as (H * capacity) rows
            cap = self.k.shape[1]
            self._next = torch.tensor([h * cap + n for h, n in enumerate(self.n)])
        at = self._next if q == 1 else (self._next[:, None] + torch.arange(q)).flatten()
        self.k.view(-1, self.k.shape[-1]).index_copy_(0, at, keys.reshape(heads * q, -1))
        self.v.view(-1, self.v.shape[-1]).index_copy_(0, at, values.reshape(heads * q, -1))
        self.p.view(-1).index_copy_(0, at, positions.expand(heads, q).reshape(-1) if q > 1 else positions.expand(heads))
        self._next += q  # kept between appends: building it cost more than a decode step's copies
        self.n = [n + q for n in self.n]


def empty_rows(heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, value_dim: int | None = None,
               grow: int = GROW) -> DenseRows:
    return DenseRows(torch.empty((heads, 0, head_dim), dtype=dtype, device=device),
                     torch.empty((heads, 0, value_dim or head_dim), dtype=dtype, device=device),
                     torch.empty((heads, 0), dtype=torch.int32, device=device), 0, grow)


def store_rows(keys: list[Tensor], values: list[Tensor], positions: list[Tensor], grow: int = GROW,
               padded: bool = False, spare: int = 0, adopt: bool = False) -> Rows:
    """Exactly these rows per head: dense if every head holds as many, ragged otherwise (`padded`: in one buffer,
    for short rows); `grow` free rows are added whenever appends fill the buffers (0: every append reallocates to
    the exact size). `spare`: free rows after dense rows from the start (rows about to be appended to: a question
    after a loaded context would otherwise copy the whole buffer to grow it). `adopt`: the caller made the heads as
    `buffer[h, :n]` of fresh (H, >= n + spare, ...) buffers for this storage alone (`reuse.prefix.import_chunks`),
    which become the storage without a copy (heads laid out otherwise are copied)."""
    n = [k.shape[0] for k in keys]
    if len(set(n)) == 1:
        laid_out = [_laid_out(ts, n[0] + spare) for ts in (keys, values, positions)] if adopt else [None]
        if all(b is not None for b in laid_out):
            return DenseRows(*laid_out, n[0], grow)
        if not spare:
            return DenseRows(torch.stack(keys), torch.stack(values), torch.stack(positions), n[0], grow)
        k, v, p = (torch.empty((len(ts), n[0] + spare, *ts[0].shape[1:]), dtype=ts[0].dtype, device=ts[0].device)
                   for ts in (keys, values, positions))
        for h in range(len(keys)):
            k[h, :n[0]], v[h, :n[0]], p[h, :n[0]] = keys[h], values[h], positions[h]
        return DenseRows(k, v, p, n[0], grow)
    if padded:
        return PaddedRows(keys, values, positions, grow)
    return RaggedRows([_own(k) for k in keys], [_own(v) for v in values], [_own(p) for p in positions], n, grow)


def _head_buffers(rows) -> tuple[list[Tensor], list[Tensor]]:
    """Per head a view of a (H, capacity, D) storage's key and value buffers, made again only when the buffers are."""
    cached = getattr(rows, "_head_views", None)
    if cached is None or cached[0] is not rows.k or cached[1] is not rows.v:
        cached = rows._head_views = (rows.k, rows.v, list(rows.k.unbind(0)), list(rows.v.unbind(0)))
    return cached[2], cached[3]


def _laid_out(heads: list[Tensor], capacity: int) -> Tensor | None:
    """The contiguous (H, >= capacity, ...) buffer whose heads start with `heads` (`heads[h]` is `buffer[h, :n]`),
    or None: rows a caller already joined where a DenseRows keeps them, adopted without a copy."""
    base = heads[0]._base
    if base is None or base.dim() != heads[0].dim() + 1 or base.shape[0] != len(heads) or base.shape[1] < capacity \
            or not base.is_contiguous():
        return None
    return base if all(t._base is base and t.is_contiguous() and t.data_ptr() == base[h].data_ptr()
                       for h, t in enumerate(heads)) else None


def _own(t: Tensor) -> Tensor:
    """`t` in storage of its own size (a view would keep its whole base tensor alive)."""
    return t if t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes else t.clone()


def import_rows(rows: ExportedRows, heads: int | None = None, head_dim: int | None = None,
                dtype: torch.dtype | None = None, spare: int = 0, adopt: bool = False) -> Rows:
    """Storage for exported rows, checked first: every head's keys, values and positions agree in length,
    positions increase, and (when given) the head count, head_dim and dtype match the layer. `spare`, `adopt`: see
    `store_rows`."""
    if rows.codec != "raw":
        raise KVMemError(f"rows use codec {rows.codec!r}; this storage reads 'raw' rows")
    if heads is not None and len(rows.heads) != heads:
        raise KVMemError(f"rows for {len(rows.heads)} KV heads; this layer has {heads}")
    for h, head in enumerate(rows.heads):
        missing = {"keys", "values", "positions"} - set(head)
        if missing:
            raise KVMemError(f"head {h} of the rows lacks {sorted(missing)}")
        k, v, p = head["keys"], head["values"], head["positions"]
        if k.dim() != 2 or v.dim() != 2 or p.dim() != 1 or not (k.shape[0] == v.shape[0] == p.shape[0]):
            raise KVMemError(f"head {h}: keys {tuple(k.shape)}, values {tuple(v.shape)} and positions "
                             f"{tuple(p.shape)} do not describe the same rows")
        if head_dim is not None and k.shape[1] != head_dim:
            raise KVMemError(f"head {h}: keys of dim {k.shape[1]}; this layer's head_dim is {head_dim}")
        if dtype is not None and (k.dtype != dtype or v.dtype != dtype):
            raise KVMemError(f"head {h}: rows in {k.dtype}; this layer holds {dtype}")
        if p.dtype != torch.int32 or (p.numel() > 1 and not bool((p[1:] > p[:-1]).all())) or (p.numel() and int(p[0]) < 0):
            raise KVMemError(f"head {h}: positions must be int32, non-negative and increasing")
    return store_rows([h["keys"] for h in rows.heads], [h["values"] for h in rows.heads],
                      [h["positions"] for h in rows.heads], spare=spare, adopt=adopt)

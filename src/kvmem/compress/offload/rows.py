"""Offloaded rows: the whole cache kept in a slower tier, a small working set attended (`OffloadedRows`).

One implementation of the row-storage contract (`kvmem/rows.py`) for the offload-and-retrieve methods
(`compress/offload/`): a layer's context rows live in a `Tier`, packed at the tier's precision (on this CPU-only
project the "slower tier" is a packed copy in host memory: `int8` / `int4` / `int2` rows quantized per row in groups of
channels with `quant/pack.py`'s real bit-packing, or `raw`, a copy in the model's dtype). What attention reads is the
resident working set, in full precision:

* the fixed rows: the first `sink` and last `recent` context rows, and every row appended later (question, answer);
* the retrieved rows: rows decoded out of the tier into the resident buffer by the policy's last retrieval, at most
  `capacity` per head (the buffer is rebuilt from the rows already resident plus the newly decoded ones: rows really
  move, and no full-precision copy of the tier is held);
* the policy's resident index (semantic vectors, centroids; a policy whose index is offline keeps it in the tier).

Each forward's attention calls `attend(query)`: the policy picks, with the query in hand, which tier rows should be
resident (or keeps the current ones), they are loaded, and the queries attend the working set head by head (heads
may hold different numbers of retrieved rows). Bytes: `kv_tensors()` is what is resident (rows attended + resident
index), `offloaded_tensors()` what the tier holds; both measured from the tensors held (`KVCache.offloaded_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvmem.attention import grouped_attention, rows_mask
from kvmem.errors import KVMemError
from kvmem.quant import pack
from kvmem.rows import ExportedRows, Rows, store_rows

if TYPE_CHECKING:
    from kvmem.compress.offload.base import OffloadMethod

TIERS = ("int8", "int4", "int2", "raw")
TIER_GROUP = 32  # channels per quantization group of a tier row (a row decodes on its own: token-granular retrieval)


class Tier:
    """Rows of every KV head packed at one precision: (H, T, D) keys and values (or keys alone: an offline index's
    summaries), positions (H, T) int32. `decode(h, idx)` returns head `h`'s rows `idx` in the model's dtype (the only
    way out of the tier)."""

    def __init__(self, keys: Tensor, values: Tensor | None, positions: Tensor, kind: str):
        if kind not in TIERS:
            raise KVMemError(f"unknown offload tier {kind!r}; choose from {', '.join(TIERS)}")
        self.kind, self.dtype, self.positions = kind, keys.dtype, positions.clone()
        self.k, self.v = self._pack(keys, "keys"), None if values is None else self._pack(values, "values")

    def _pack(self, t: Tensor, name: str):
        if self.kind == "raw":
            return t.clone()
        if t.shape[-1] % TIER_GROUP:
            raise KVMemError(f"tier {self.kind}: {name} of head_dim {t.shape[-1]} do not split into groups of "
                             f"{TIER_GROUP} channels; use tier=raw")
        return pack.quantize(t, int(self.kind[3:]), TIER_GROUP)

    @property
    def rows(self) -> int:
        return int(self.positions.shape[1])

    def decode(self, head: int, idx: Tensor) -> tuple[Tensor, Tensor]:
        """Head `head`'s rows at `idx` (sorted indices into the tier's rows): keys and values (n, D), decoded."""
        return self._decode(self.k, head, idx), self._decode(self.v, head, idx)

    def decode_keys(self, head: int, idx: Tensor) -> Tensor:
        return self._decode(self.k, head, idx)

    def _decode(self, stored, head: int, idx: Tensor) -> Tensor:
        if self.kind == "raw":
            return stored[head].index_select(0, idx)
        return pack.dequantize(head_rows(stored, head, idx))

    def tensors(self) -> list[Tensor]:
        held = [t for t in (self.k, self.v) if t is not None]
        return held if self.kind == "raw" else [x for t in held for x in t.tensors()]


def head_rows(q: pack.Quantized, head: int, idx: Tensor) -> pack.Quantized:
    """Rows `idx` of head `head` of packed (H, N, M) codes grouped along the last dim (a tier's rows; sparq's channels):
    their codes and scales alone."""
    return pack.Quantized(q.packed[head].index_select(0, idx), q.scale[head].index_select(0, idx),
                          q.zero[head].index_select(0, idx), q.bits, q.group, 1, (int(idx.numel()), q.shape[-1]), q.dtype)


class OffloadedRows(Rows):
    """A layer's rows with the context offloaded to a `Tier` and a bounded working set resident (the module doc)."""

    retrieves = True  # KVLayer routes this layer's attention through `attend` (it retrieves with the query in hand)

    def __init__(self, tier: Tier, fixed: Rows, method: "OffloadMethod", index: dict, capacity: int, layer: int):
        self.tier, self.fixed, self.method, self.index = tier, fixed, method, index
        self.capacity, self.layer = capacity, layer
        heads, dtype = fixed.num_heads, tier.dtype
        self.rk = [torch.empty((0, fixed.heads()[0][0].shape[-1]), dtype=dtype) for _ in range(heads)]
        self.rv = [torch.empty((0, fixed.heads()[0][1].shape[-1]), dtype=dtype) for _ in range(heads)]
        self.rp = [torch.empty(0, dtype=torch.int32) for _ in range(heads)]
        self.ridx = [torch.empty(0, dtype=torch.long) for _ in range(heads)]  # tier row of each retrieved row
        self.state: dict = {}  # the policy's memory between steps (LouisKV's last probe)
        self.retrievals = 0  # forwards whose policy chose rows (LouisKV skips some)
        self.decoded_rows = 0  # rows decoded out of the tier into the resident buffer, all heads
        self.peak_retrieved_bytes = 0  # the most bytes the retrieved rows held at once (measured after each load)

    # -- the storage contract ---------------------------------------------------------------------------
    def lengths(self) -> list[int]:
        return [n + int(p.numel()) for n, p in zip(self.fixed.lengths(), self.rp)]

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """The resident rows per head, in position order (what attention reads)."""
        out = []
        for (k, v, p), rk, rv, rp in zip(self.fixed.heads(), self.rk, self.rv, self.rp):
            pos = torch.cat([rp, p])
            order = pos.argsort()
            out.append((torch.cat([rk, k])[order], torch.cat([rv, v])[order], pos[order]))
        return out

    def stacked(self):
        return None  # attention reads the working set through `attend`

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        self.fixed.append(keys, values, positions)

    def keep(self, indices: list[Tensor]) -> Rows:
        raise KVMemError("an offloaded layer keeps every row (in its tier); it cannot also be evicted")

    def kv_tensors(self) -> list[Tensor]:
        """What is resident: the fixed and retrieved rows and the policy's resident index."""
        return [*self.fixed.kv_tensors(), *self.rk, *self.rv, *self.index.get("resident", [])]

    def position_tensors(self) -> list[Tensor]:
        return [*self.fixed.position_tensors(), *self.rp, *self.index.get("state", [])]

    def offloaded_tensors(self) -> list[Tensor]:
        """What the tier holds: the offloaded rows (and an offline index)."""
        return [*self.tier.tensors(), *self.index.get("offline", [])]

    def export_rows(self) -> ExportedRows:
        raise KVMemError("an offloaded cache is not exported: its rows are split between a tier and a working set "
                         "(store the full cache, or an evicted one)")

    def with_rows(self, keys, values, positions) -> Rows:
        raise KVMemError("an offloaded layer's rows are not rebuilt; offload a full-precision cache")

    def kernel_heads(self):
        raise KVMemError("an offloaded layer attends through its own retrieval, not the decode kernel")

    # -- retrieval ----------------------------------------------------------------------------------------
    def load(self, chosen: list[Tensor]) -> None:
        """Make exactly the tier rows `chosen[h]` (indices, any order, at most `capacity`) head h's retrieved rows:
        rows already resident stay, the others are decoded out of the tier; rows no longer chosen are released."""
        for h, idx in enumerate(chosen):
            idx = idx.to(torch.long).unique(sorted=True)
            if idx.numel() > self.capacity:
                raise KVMemError(f"policy {self.method.name} chose {idx.numel()} rows for head {h}; the resident "
                                 f"buffer holds {self.capacity}")
            old = self.ridx[h]
            at = torch.searchsorted(old, idx).clamp_max(max(old.numel() - 1, 0))
            held = (old[at] == idx) if old.numel() else torch.zeros_like(idx, dtype=torch.bool)
            new = idx[~held]
            k = self.rk[h].new_empty((idx.numel(), self.rk[h].shape[-1]))
            v = self.rv[h].new_empty((idx.numel(), self.rv[h].shape[-1]))
            if held.any():
                k[held], v[held] = self.rk[h][at[held]], self.rv[h][at[held]]
            if new.numel():
                k[~held], v[~held] = self.tier.decode(h, new)
            self.rk[h], self.rv[h], self.ridx[h] = k, v, idx
            self.rp[h] = self.tier.positions[h].index_select(0, idx)
            self.decoded_rows += int(new.numel())
        held = sum(t.untyped_storage().nbytes() for t in (*self.rk, *self.rv))
        self.peak_retrieved_bytes = max(self.peak_retrieved_bytes, held)

    def attend(self, query: Tensor, new_pos: Tensor, scaling: float) -> Tensor:
        """This forward's attention, query (1, Hq, Q, D): the policy retrieves with the queries in hand, then each
        KV head's query group attends its resident rows. Returns (1, Q, Hq, D)."""
        q = query[0].detach()
        group = q.shape[0] // self.fixed.num_heads
        chosen = self.method.retrieve(self, [q[h * group:(h + 1) * group] for h in range(self.fixed.num_heads)], scaling)
        if chosen is not None:
            self.load(chosen)
            self.retrievals += 1
        outs = []
        for h, (k, v, p) in enumerate(self.fixed.heads()):
            keys, values = torch.cat([self.rk[h], k]), torch.cat([self.rv[h], v])
            mask = rows_mask(torch.cat([self.rp[h], p])[None], new_pos, None)
            out = grouped_attention(query[:, h * group:(h + 1) * group], keys[None, None], values[None, None],
                                    None if mask is None else mask[None], scaling)
            outs.append(self.method.interpolate(self, h, query[:, h * group:(h + 1) * group], out, new_pos, scaling))
        return torch.cat(outs, dim=2)


def offload_layer(layer, method: "OffloadMethod", keep_ratio: float, ids: list[int] | None,
                  protect_from: int | None = None) -> OffloadedRows | None:
    """`layer`'s rows (every head holding the same context rows) split into a tier and a resident working set whose
    bytes are at most `keep_ratio` of the context rows' bytes in the model's dtype: sinks, recent rows, the resident
    index, and the retrieved rows' buffer (what is left of the budget). Rows at positions >= `protect_from` stay
    resident, outside the budget. None when the context fits in the sink and recent rows, which stay resident anyway:
    there is nothing to offload (a short prompt), and the layer is left as it is."""
    stacked = layer.rows.stacked()
    if stacked is None or type(layer.rows).__name__ != "DenseRows" or layer.quant is not None or layer.evicted():
        raise KVMemError(f"{method.name} offloads a full-precision cache whose heads hold the same rows (no eviction "
                         "or quantization before it)")
    keys, values, positions = stacked
    total = keys.shape[1]
    n = total if protect_from is None else int((positions[0] < protect_from).sum())
    sink, recent = min(method.sink, n), min(method.recent, max(n - method.sink, 0))
    middle = slice(sink, n - recent)
    if n - sink - recent <= 0:
        return None
    mk, mv, mp = keys[:, middle], values[:, middle], positions[:, middle]
    index = method.build_index(mk, mp, ids, layer)
    row_bytes = mk.shape[0] * (mk.shape[-1] + mv.shape[-1]) * mk.element_size()  # one token, every head
    resident_index = sum(t.numel() * t.element_size() for t in index.get("resident", []))
    budget = keep_ratio * n * row_bytes
    capacity = int((budget - (sink + recent) * row_bytes - resident_index) // row_bytes)
    if capacity < 1:
        raise KVMemError(f"{method.name} at keep ratio {keep_ratio:g}: {n} context tokens give a resident budget of "
                         f"{int(budget)} bytes per layer, and sink={sink} + recent={recent} rows plus the index "
                         f"({resident_index} bytes) leave no room for retrieved rows; raise the keep ratio or lower "
                         "sink / recent")
    ends = torch.cat([keys[:, :sink], keys[:, n - recent:]], 1), torch.cat([values[:, :sink], values[:, n - recent:]], 1)
    ends_pos = torch.cat([positions[:, :sink], positions[:, n - recent:]], 1)  # recent rows and any protected ones
    fixed = store_rows(list(ends[0].clone()), list(ends[1].clone()), list(ends_pos.clone()))
    return OffloadedRows(Tier(mk, mv, mp, method.tier), fixed, method, index, capacity, layer.layer_idx)

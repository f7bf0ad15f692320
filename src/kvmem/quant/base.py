"""Quantized row storage: the `Rows` contract (`kvmem.rows`) with keys and values held as packed codes.

A `Scheme` encodes blocks of `group` tokens of one head (keys and values) into `Quantized` tensors and
decodes them. `QuantizedRows` holds, per head, the encoded blocks joined into one packed tensor per K and
V, plus a full-precision residual: the newest `residual` rows and those that do not yet fill a block
(KIVI's recent window), and, in heads of different lengths, up to one more block waiting for the other heads' (`flush`). The layer calls `flush()` after each forward's attention, so the tokens of a forward are
attended at full precision by that forward (as in KIVI and transformers' QuantizedCache) and held packed afterwards.

How a forward reads them: a decode step of a scheme with a kernel (`Scheme.has_decode_kernel`: KIVI's codes,
`kvmem.kernel`) attends the codes in place (`kvmem.attention.attend_in_place`); otherwise the heads are decoded into one
buffer, (H, T, D) when they hold as many rows (`stacked`) or one row axis when they do not (`flat`).

Eviction composes: `keep()` on quantized rows decodes, selects and re-encodes the kept rows in new blocks
(the compressor runs before the flush, so in `prefill -> compress -> decode` the kept rows are encoded
once, from full precision). A sliding layer drops whole blocks only (`drop_prefix`); rows of a partly
expired block stay and the position mask hides them, so nothing is re-encoded as the window moves.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.encoded import EXPORT_FORMAT, LAYER_FORMAT, flatten, unflatten
from kvmem.quant.pack import Quantized
from kvmem.rows import ExportedRows, KernelRows, Rows, empty_rows, store_rows


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
    encoded_types: ClassVar[tuple[type, ...]] = (Quantized,)  # what `encode` returns, nested types too (export/import)
    bits: float  # average bits per stored element, codes only (scales, zero-points and outliers add to it)
    group: int
    residual: int = 0  # the newest rows kept in full precision beyond the incomplete block (KIVI's R)

    def check(self, head_dim: int) -> None:
        """Raise a KVMemError if the scheme cannot hold heads of this size."""

    def encoded_type_names(self) -> dict[str, type]:
        return {t.__name__: t for t in self.encoded_types}

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

    # Joined codes: every head's encoded rows held as one tensor per K and V, so a forward decodes all heads in one
    # pass (per-op overhead, not arithmetic, is most of a quantized decode step on CPU). A scheme that joins its codes
    # implements these three; the others decode head by head (`decode_heads`).
    def join_heads(self, parts: list[Encoded | None], stacked: bool) -> Encoded | None:
        """The heads' encoded rows joined: stacked (H, n, ...) when they hold as many, else concatenated along rows
        in the order given (head order; a head may come in several consecutive parts; None parts hold no rows); None
        where the scheme does not join its codes."""
        return None

    def split_heads(self, joined: Encoded, counts: list[int], stacked: bool) -> list[Encoded | None]:
        """Per head views of `join_heads`'s output (no copy); `counts` rows each."""
        raise NotImplementedError

    def decode_joined(self, keys: Encoded, values: Encoded, positions: Tensor, out_keys: Tensor, out_values: Tensor) -> None:
        """`join_heads`'s keys and values, at positions of the same layout ((H, n) or (N,)), decoded into `out_keys` /
        `out_values` ((H, n, D) or (N, D))."""
        raise NotImplementedError

    def has_decode_kernel(self, head_dim: int) -> bool:
        """Whether `decode_attention` reads this scheme's codes for heads of `head_dim`."""
        return False

    def decode_attention(self, query: Tensor, rows: list[KernelRows], scaling: float) -> Tensor:
        """A decode step of B sequences, query (B, Hq, D), each query head over its KV head's rows of its sequence
        (`QuantizedRows.kernel_rows`, all visible), read in place without decoding: (B, Hq, D). Called only where
        `has_decode_kernel`; elsewhere the rows are decoded and attended by SDPA."""
        raise NotImplementedError

    @property
    def spec(self) -> str:
        return self.name


class QuantizedRows(Rows):
    """Per head: the encoded blocks (`qk`, `qv`) and their positions (`pq`), then the full-precision residual (`res`,
    a `DenseRows` while heads hold as many residual rows: a decode step appends in place, no copy of what is held).
    Where the scheme joins its codes (`Scheme.join_heads`), the heads' encoded rows are held as one tensor per K and V
    (`qk[h]` are views of it), so a forward decodes every head in one pass: into (H, T, D) when heads hold as many
    rows (`stacked`), else into one (N, D) row axis (`flat`)."""

    def __init__(self, scheme: Scheme, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None):
        self.scheme, self.dtype = scheme, dtype
        self.codec = scheme.spec
        self.qk: list[Encoded | None] = [None] * heads  # encoded rows, oldest first
        self.qv: list[Encoded | None] = [None] * heads
        self.pq = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(heads)]  # the encoded rows' positions
        # residual rows, newest last; a full buffer grows by one block (`group` rows), so a decode step appends in place
        # and the spare rows stay under a block (a short quantized cache must not hold more than raw)
        self.res: Rows = empty_rows(heads, head_dim, dtype, device, value_dim, grow=scheme.group)
        self._join: tuple | None = None  # the heads' encoded rows joined (`_joined`)
        self._kernel: bool | None = None  # whether the scheme's decode kernel reads these rows (`decodes_in_place`)

    @classmethod
    def of(cls, scheme: Scheme, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> QuantizedRows:
        """These rows per head, encoded in blocks (the remainder stays in the residual)."""
        rows = cls(scheme, len(keys), keys[0].shape[-1], keys[0].dtype, keys[0].device, values[0].shape[-1])
        rows.res = store_rows([k.clone() for k in keys], [v.clone() for v in values], [p.clone() for p in positions],
                              grow=scheme.group)
        rows.flush()
        return rows

    def with_rows(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> QuantizedRows:
        return QuantizedRows.of(self.scheme, keys, values, positions)

    def lengths(self) -> list[int]:
        return [p.numel() + r for p, r in zip(self.pq, self.res.lengths())]

    def positions(self) -> list[Tensor]:
        return [torch.cat([pq, rp]) for pq, rp in zip(self.pq, self.res.positions())]

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        out = []
        for h, (qk, qv, pq, (rk, rv, rp)) in enumerate(zip(self.qk, self.qv, self.pq, self.res.heads())):
            if qk is None:
                out.append((rk, rv, rp))
                continue
            k, v = self.scheme.decode(qk, qv, pq, h)
            out.append((torch.cat([k, rk]), torch.cat([v, rv]), torch.cat([pq, rp])))
        return out

    def stacked(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """Every head decoded straight into one (H, T, D) buffer per K and V (no per-head copies to join):
        what a forward's attention reads. Freed after that forward; only the encoded rows are held."""
        lengths = self.lengths()
        if len(set(lengths)) != 1:
            return None
        res = self.res.stacked()
        if res is None:  # as many rows per head, split differently between encoded and residual
            return super().stacked()
        rk, rv, rp = res
        n = lengths[0] - rk.shape[1]
        keys = rk.new_empty((len(lengths), lengths[0], rk.shape[-1]))
        values = rv.new_empty((len(lengths), lengths[0], rv.shape[-1]))
        joined = self._joined(stacked=True) if n else None
        if joined is not None:
            self.scheme.decode_joined(joined[0], joined[1], joined[2], keys[:, :n], values[:, :n])
            positions = torch.cat([joined[2], rp], dim=1)
        else:
            self.scheme.decode_heads(self.qk, self.qv, self.pq, keys, values)
            positions = torch.cat([torch.stack(self.pq), rp], dim=1)
        keys[:, n:], values[:, n:] = rk, rv
        return keys, values, positions

    def flat(self) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """Every head's rows decoded into one (N, D) buffer per K and V, rows of all heads along one axis (encoded rows
        head by head, then the residual rows head by head), with their positions (N,) and KV heads (N,): what a
        forward's attention reads when heads hold different numbers of rows (`kvmem.attention.flat_attention`).
        None where the scheme does not join its codes."""
        joined = self._joined(stacked=False) if any(p.numel() for p in self.pq) else None
        if joined is None and any(p.numel() for p in self.pq):
            return None
        res = self.res.heads()
        n = joined[2].numel() if joined is not None else 0
        total = n + sum(p.numel() for _, _, p in res)
        rk, rv = res[0][0], res[0][1]
        keys, values = rk.new_empty((total, rk.shape[-1])), rv.new_empty((total, rv.shape[-1]))
        if joined is not None:
            self.scheme.decode_joined(joined[0], joined[1], joined[2], keys[:n], values[:n])
        torch.cat([k for k, _, _ in res], out=keys[n:])
        torch.cat([v for _, v, _ in res], out=values[n:])
        heads = torch.arange(len(res), dtype=torch.int32)
        res_heads = heads.repeat_interleave(torch.tensor([p.numel() for _, _, p in res]))
        positions = torch.cat([p for _, _, p in res] if joined is None else [joined[2], *(p for _, _, p in res)])
        return keys, values, positions, res_heads if joined is None else torch.cat([joined[3], res_heads])

    def decodes_in_place(self) -> bool:
        """Whether `decode_attention` can serve the next decode step (the scheme has a kernel for these rows)."""
        if self._kernel is None:  # (asked for every row and layer of every decode step: the scheme's answer is kept)
            self._kernel = self.dtype == torch.float32 and self.scheme.has_decode_kernel(self.res.kv_tensors()[0].shape[-1])
        return self._kernel and any(p.numel() for p in self.pq) and self._joined(stacked=False) is not None

    def kernel_key(self) -> tuple:
        """Rows with equal keys share one kernel call: the scheme's kernel, bits and groups."""
        keys, values = self._joined(stacked=False)[:2]
        return type(self.scheme).decode_attention, keys.bits, keys.group, values.bits, values.group

    def kernel_rows(self) -> KernelRows:
        """The codes and the residual (views, nothing copied); only where `decodes_in_place()`."""
        keys, values, _, _, offsets = self._joined(stacked=False)
        return KernelRows(keys, values, offsets, *self.res.kernel_heads())

    def attend_kernel(self, query: Tensor, rows: list[KernelRows], scaling: float) -> Tensor:
        return self.scheme.decode_attention(query, rows, scaling)

    def _joined(self, stacked: bool, parts: tuple[list, list] | None = None
                ) -> tuple[Encoded, Encoded, Tensor, Tensor, Tensor] | None:
        """The heads' encoded rows joined (`Scheme.join_heads`), their positions in the same layout, (flat) the KV head
        of each row and each head's first row (H + 1 offsets); made once after each change. The per-head rows become
        views of it: nothing is held twice. `parts` (flat only): the keys' and values' pieces in row order, each head's
        one after another, where the heads' rows are not yet joined per head (`flush`)."""
        if self._join is None or self._join[0] != stacked:
            keys = self.scheme.join_heads(parts[0] if parts else self.qk, stacked)
            if keys is None:
                return None
            self._hold_joined(stacked, keys, self.scheme.join_heads(parts[1] if parts else self.qv, stacked))
        return self._join[1:]

    def _hold_joined(self, stacked: bool, keys: Encoded, values: Encoded) -> None:
        """Hold joined codes (the per-head rows become views of them) with their positions, rows' heads and offsets."""
        counts = [p.numel() for p in self.pq]
        self.qk, self.qv = self.scheme.split_heads(keys, counts, stacked), self.scheme.split_heads(values, counts, stacked)
        heads = torch.arange(len(counts), dtype=torch.int32).repeat_interleave(torch.tensor(counts))
        offsets = torch.tensor([0] + counts).cumsum(0)
        self._join = (stacked, keys, values, torch.stack(self.pq) if stacked else torch.cat(self.pq), heads, offsets)

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        self.res.append(keys, values, positions)

    def flush(self) -> None:
        """Encode the full blocks of residual rows older than the scheme's `residual` newest rows, once every head
        has one (or some head has two): heads evicted to different lengths fill their blocks at different steps, and
        encoding them together is one pass over the layer's codes where head by head was three (a decode step of 7
        rows at 4k spent 14 of 125 ms in flushes). A head's residual therefore holds up to `residual + 2 * group - 1`
        rows."""
        g = self.scheme.group
        counts = [max(n - self.scheme.residual, 0) // g * g for n in self.res.lengths()]
        if not any(counts) or (min(counts) == 0 and max(counts) < 2 * g):  # (most decode steps: before any view is made)
            return
        res = self.res.heads()
        if len(set(counts)) == 1:  # every head encodes as many rows: all in one pass
            n = counts[0]
            encoded = self.scheme.encode_heads(*(torch.stack([t[:n] for t in part]) for part in zip(*res)))
        else:
            encoded = [self.scheme.encode(k[:n], v[:n], p[:n], h) if n else None
                       for h, ((k, v, p), n) in enumerate(zip(res, counts))]
        # codes joined along rows (the decode kernel's layout) are joined again in one concatenation of every head's
        # held and new blocks, not copied head by head and then joined: a flush copies the layer's codes once
        rejoin_flat = self._join is not None and not self._join[0]
        parts: tuple[list, list] = ([], [])
        for h, ((_, _, p), n, kv) in enumerate(zip(res, counts, encoded)):
            k, v = kv if n else (None, None)
            if rejoin_flat:
                parts[0].extend((self.qk[h], k))
                parts[1].extend((self.qv[h], v))
            elif n:
                self.qk[h] = k if self.qk[h] is None else self.qk[h].cat(k)
                self.qv[h] = v if self.qv[h] is None else self.qv[h].cat(v)
            if n:
                self.pq[h] = torch.cat([self.pq[h], p[:n]])
        self.res = store_rows(*([t[n:] for t, n in zip(part, counts)] for part in zip(*res)), grow=g, padded=True)
        if rejoin_flat:
            self._join = None
            self._joined(False, parts)
        else:
            self._rejoin()

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
            encoded = self.pq[h].numel()
            blocks = min(n, encoded) // g * g
            if not blocks:
                continue
            self.qk[h] = self.qk[h].drop(blocks) if blocks < encoded else None
            self.qv[h] = self.qv[h].drop(blocks) if blocks < encoded else None
            self.pq[h] = self.pq[h][blocks:].clone()
        self._rejoin()

    def _rejoin(self) -> None:
        """After the encoded rows changed: join them again at once, so heads left unchanged stop being views of the old
        joined tensors (which they would otherwise keep alive until the next forward)."""
        if self._join is not None:
            stacked, self._join = self._join[0], None
            if self._joined(stacked) is None:
                self._joined(False)

    def kv_tensors(self) -> list[Tensor]:
        if self._join is not None:  # every head's codes are views of the joined ones: 6 storages, not 6 a head
            held = [t for q in self._join[1:3] for t in q.tensors()]
        else:
            held = [t for q in (*self.qk, *self.qv) if q is not None for t in q.tensors()]
        return held + self.res.kv_tensors()

    def position_tensors(self) -> list[Tensor]:
        return list(self.pq) + self.res.position_tensors()

    def export_rows(self) -> ExportedRows:
        """The rows as held, not decoded: per head the encoded tensors (`k.*`, `v.*`), the full-precision residual
        and the positions; the codec is the scheme's spec, and what is not a tensor (bit widths, shapes, the
        encoded types) goes into `meta`. `import_encoded` rebuilds exactly these rows."""
        heads, head_meta = [], []
        for qk, qv, pq, (rk, rv, rp) in zip(self.qk, self.qv, self.pq, self.res.heads()):
            tensors = {"positions": torch.cat([pq, rp]), "residual_keys": rk.clone(), "residual_values": rv.clone()}
            meta: dict = {}
            for prefix, q in (("k", qk), ("v", qv)):
                if q is not None:
                    flatten(q, prefix, tensors, meta, self.scheme.encoded_type_names())
            heads.append(tensors)
            head_meta.append(meta)
        return ExportedRows(heads, codec=self.codec, meta={"format": EXPORT_FORMAT, "dtype": str(self.dtype).split(".")[-1],
                                                           "heads": head_meta})

    def export_layer(self) -> tuple[dict[str, Tensor], dict] | None:
        """The rows as held, in one set of tensors for the whole layer (the per-layer layout, `LAYER_FORMAT`): the
        heads' codes stacked (`k.*`, `v.*`: (H, n, ...)), the residual (H, r, D) and the positions (H, n + r), with
        `meta` as `export_rows` writes it. For a layer whose heads hold as many encoded and residual rows (a stored
        chunk) and whose scheme stacks `Quantized` codes (KIVI); None otherwise (use `export_rows`). `import_layer`
        reads it in a few operations per layer where `import_encoded` takes a few per head."""
        counts, lengths = {p.numel() for p in self.pq}, set(self.lengths())
        if len(counts) != 1 or len(lengths) != 1 or not counts.pop() or self.scheme.encoded_types != (Quantized,):
            return None
        joined, res = self._joined(stacked=True), self.res.stacked()
        if joined is None or res is None:
            return None
        keys, values, positions = joined[:3]
        rk, rv, rp = res
        tensors = {"positions": torch.cat([positions, rp], dim=1), "residual_keys": rk.clone(),
                   "residual_values": rv.clone()}
        meta: dict = {}
        for prefix, q in (("k", keys), ("v", values)):
            flatten(q, prefix, tensors, meta, self.scheme.encoded_type_names())
        return tensors, {"format": LAYER_FORMAT, "codec": self.codec, "dtype": str(self.dtype).split(".")[-1],
                         "codes": meta}

    @classmethod
    def import_layer(cls, scheme: Scheme, tensors: dict[str, Tensor], meta: dict) -> QuantizedRows:
        """Rows exported by `export_layer` from a layer of the same scheme, checked as `import_encoded` checks them
        (codec, format, types, dtype, positions int32 and increasing, encoded + residual rows adding up) and the codes'
        tensors against their shapes (`Quantized.check`): stored state is never trusted."""
        if meta.get("codec") != scheme.spec:
            raise KVMemError(f"rows are encoded as {meta.get('codec')!r}; this layer holds {scheme.spec!r}")
        if meta.get("format") != LAYER_FORMAT:
            raise KVMemError(f"encoded layer of an unknown format {meta.get('format')!r} (this kvmem reads "
                             f"{LAYER_FORMAT})")
        dtype = getattr(torch, str(meta.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise KVMemError(f"encoded rows name an unknown dtype {meta.get('dtype')!r}")
        if missing := {"positions", "residual_keys", "residual_values"} - set(tensors):
            raise KVMemError(f"the encoded layer lacks {sorted(missing)}")
        types = scheme.encoded_type_names()
        keys, values = (unflatten(prefix, tensors, meta.get("codes") or {}, types) for prefix in ("k", "v"))
        p, rk, rv = tensors["positions"], tensors["residual_keys"], tensors["residual_values"]
        if p.dtype != torch.int32 or p.dim() != 2 or (p.shape[1] > 1 and not bool((p[:, 1:] > p[:, :-1]).all())):
            raise KVMemError("positions must be int32 (heads, rows) and increasing")
        heads, rows = p.shape
        for what, q in (("keys", keys), ("values", values)):
            if type(q) is not Quantized:
                raise KVMemError(f"encoded {what} of type {type(q).__name__}; the per-layer layout holds Quantized "
                                 f"codes")
            q.check()
            if len(q.shape) != 3 or q.shape[0] != heads or q.dtype != dtype:
                raise KVMemError(f"encoded {what} of shape {q.shape} {q.dtype}, for {heads} heads of {dtype}")
        n = keys.shape[1]
        residual = [(heads, rows - n, keys.shape[2]), (heads, rows - n, values.shape[2])]
        if values.shape[1] != n or [tuple(rk.shape), tuple(rv.shape)] != residual:
            raise KVMemError(f"encoded ({n}) and residual rows {tuple(rk.shape)}, {tuple(rv.shape)} do not add up to "
                             f"the heads' {rows} positions")
        out = cls(scheme, heads, keys.shape[2], dtype, p.device, values.shape[2])
        out.pq = list(p[:, :n].clone().unbind(0))
        out._hold_joined(True, keys, values)
        out.res = store_rows(list(rk.unbind(0)), list(rv.unbind(0)), list(p[:, n:].unbind(0)), grow=scheme.group,
                             padded=True)
        return out

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
        residual, types = [], scheme.encoded_type_names()
        for h, (tensors, meta) in enumerate(zip(rows.heads, rows.meta["heads"])):
            qk, qv = (unflatten(prefix, tensors, meta, types) if f"{prefix}.__type" in meta else None for prefix in ("k", "v"))
            p = tensors["positions"]
            if p.dtype != torch.int32 or p.dim() != 1 or (p.numel() > 1 and not bool((p[1:] > p[:-1]).all())):
                raise KVMemError(f"head {h}: positions must be int32 and increasing")
            n = p.numel()
            encoded = qk.rows if qk is not None else 0
            if (qv.rows if qv is not None else 0) != encoded or encoded + tensors["residual_keys"].shape[0] != n \
                    or tensors["residual_values"].shape[0] != n - encoded:
                raise KVMemError(f"head {h}: encoded and residual rows do not add up to its {n} positions")
            out.qk[h], out.qv[h] = qk, qv
            out.pq[h] = p[:encoded].clone()
            residual.append((tensors["residual_keys"], tensors["residual_values"], p[encoded:]))
        out.res = store_rows(*map(list, zip(*residual)), grow=scheme.group, padded=True)
        return out

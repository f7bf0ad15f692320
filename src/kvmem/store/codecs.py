"""Chunk codecs: how one chunk's rows (every layer's `ExportedRows`) become named tensors plus JSON metadata.

A codec has a canonical `spec` and a `version`; both go into the chunk keys' namespace and into every
stored chunk, and a chunk of another codec or version is refused on read (recomputed, never decoded).

* `raw`: rows as the cache held them, bit for bit (reuse is exact): keys and values in the model's dtype, or a
  quantized layer's codes as it held them (`ExportedRows` of its scheme's codec: a stored compressed span of a
  quantized cache is loaded without re-encoding, and reads a quarter of the bytes at 8 bits).
* `quant:<scheme>`: any `kvmem.quant` scheme (e.g. `quant:kivi-8`, `quant:kvquant-2`), every full block
  of `group` rows encoded (no full-precision residual window in storage), the rest raw.
* `cachegen`: CacheGen's bitstream (quantize, delta against anchor tokens, arithmetic-code); `cachegen.py`.

`encode` and `decode` see whole chunks: `layers[l].heads[h]` holds `keys` (T, D), `values` (T, D),
`positions` (T,) int32 and optionally `log_weights` (T,). `decode` returns raw rows in the same form, a layer whose
heads hold as many rows as a `DenseExport` ((H, T, D) tensors; the heads are views made when asked for).

Stored layouts (version 2 of both codecs; a chunk of version 1 is refused by its header, never decoded): `raw` keeps
such a layer as `l.keys`, `l.values`, `l.positions` (one tensor each for its heads), other layers head by head
(`l.h.keys`, ...); `quant` keeps a layer of a scheme that stacks its codes (KIVI) as one set of tensors
(`QuantizedRows.export_layer`, layout "layer"), others head by head (`export_rows`, layout "heads"). Why: at 8k
tokens of SmolLM2 a load made and checked ~3k heads one by one, and the per-head Python work was most of the decode.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme
from kvmem.rows import DenseExport, ExportedRows
from kvmem.store.cachegen import parse_cachegen
from kvmem.store.codec import Codec, _tensor


class RawCodec(Codec):
    name = "raw"
    version = 2  # 2: a layer whose heads hold as many rows is stored as (H, T, D) tensors (1: always head by head)
    lossless = True
    carries_encoded = True

    def encode(self, layers: list[ExportedRows]) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        encoded = []  # per layer: None (raw rows), or the codec, metadata and field names of rows held encoded
        dense = []  # per layer: raw rows of equally long heads, stored as one tensor per field (decoded as DenseExport)
        for l, rows in enumerate(layers):
            stack = rows.codec == "raw" and _dense(rows)
            if stack:
                for field in ("keys", "values", "positions"):
                    tensors[f"{l}.{field}"] = (getattr(rows, field) if isinstance(rows, DenseExport) else
                                               torch.stack([head[field] for head in rows.heads]))
            else:
                for h, head in enumerate(rows.heads):
                    for field, t in head.items():
                        tensors[f"{l}.{h}.{field}"] = t.contiguous()
            dense.append(stack)
            encoded.append(None if rows.codec == "raw" else
                           {"codec": rows.codec, "meta": rows.meta, "fields": [sorted(head) for head in rows.heads]})
        meta = {"heads": [len(r.heads) for r in layers], "dense": dense,
                "weighted": [any("log_weights" in h for h in r.heads) for r in layers]}
        return tensors, meta | ({"encoded": encoded} if any(encoded) else {})

    def layer_count(self, meta: dict) -> int:
        n = len(meta["heads"])
        if not n == len(meta["weighted"]) == len(meta.get("encoded") or [None] * n) == len(meta.get("dense") or [False] * n):
            raise KVMemError("chunk metadata of different lengths per layer")
        return n

    def decode_layer(self, tensors: dict[str, Tensor], meta: dict, l: int) -> ExportedRows:
        fields = ("keys", "values", "positions")
        n_heads, weighted = meta["heads"][l], meta["weighted"][l]
        held = (meta.get("encoded") or [None] * len(meta["heads"]))[l]
        stacked = (meta.get("dense") or [False] * len(meta["heads"]))[l]
        if stacked:  # shapes checked by the store (`_check_layer`) before any head is read
            k, v, p = (_tensor(tensors, f"{l}.{f}") for f in fields)
            if k.dim() != 3 or k.shape[0] != n_heads or v.shape != k.shape or p.shape != k.shape[:2]:
                raise KVMemError(f"layer {l}: keys {tuple(k.shape)}, values {tuple(v.shape)}, positions "
                                 f"{tuple(p.shape)} are not {n_heads} heads of as many rows")
            return DenseExport(k, v, p)
        if held:  # checked against the layer's scheme when imported (QuantizedRows.import_encoded)
            if len(held["fields"]) != n_heads:
                raise KVMemError(f"layer {l}: {len(held['fields'])} heads of encoded fields, {n_heads} heads")
            heads = [{f: _tensor(tensors, f"{l}.{h}.{f}") for f in names} for h, names in enumerate(held["fields"])]
            return ExportedRows(heads, held["codec"], held["meta"])
        return ExportedRows([{f: _tensor(tensors, f"{l}.{h}.{f}") for f in fields + (("log_weights",) if weighted else ())}
                             for h in range(n_heads)])


def _dense(rows: ExportedRows) -> bool:
    """Raw rows whose heads all hold as many rows and nothing but keys, values and positions (an uncompressed chunk)."""
    if isinstance(rows, DenseExport):
        return True
    return bool(rows.heads) and all(set(h) == {"keys", "values", "positions"} for h in rows.heads) and \
        len({h["positions"].shape[0] for h in rows.heads}) == 1


class QuantCodec(Codec):
    """Rows stored as a `kvmem.quant` scheme holds them (packed codes, scales, outliers), decoded on read."""

    name = "quant"
    version = 2  # 2: a layer of a scheme that stacks its codes (KIVI) stored as one set of tensors, with a layout tag

    def __init__(self, scheme: str):
        from kvmem.quant import get_scheme

        self.scheme = get_scheme(scheme)  # a bad name fails here, before any model work
        if type(self.scheme).new_rows is not Scheme.new_rows:
            raise KVMemError(f"{self.scheme.spec} keeps its own row layout (mixed precision); the store cannot encode "
                             f"chunks with it: use a plain scheme such as quant:kivi-4")
        self._spec = f"quant:{self.scheme.spec}"
        self.scheme.residual = 0  # storage keeps no full-precision recent window

    @property
    def spec(self) -> str:
        return self._spec

    def for_model(self, lm) -> QuantCodec:
        out = copy.copy(self)
        if self.scheme.calibrated:
            out.scheme = self.scheme.prepare(lm)
            out.scheme.residual = 0
        return out

    def encode(self, layers: list[ExportedRows]) -> tuple[dict[str, Tensor], dict]:
        from kvmem.quant import QuantizedRows

        tensors: dict[str, Tensor] = {}
        metas = []
        for l, rows in enumerate(layers):
            if any("log_weights" in h for h in rows.heads):
                raise KVMemError("the quant codec cannot store rows that stand for several tokens (log-weights); use raw")
            held = QuantizedRows.of(self.scheme.for_layer(l), [h["keys"] for h in rows.heads],
                                    [h["values"] for h in rows.heads], [h["positions"] for h in rows.heads])
            layer = held.export_layer()  # one set of tensors for the layer where the scheme stacks its codes (KIVI)
            if layer is not None:
                for field, t in layer[0].items():
                    tensors[f"{l}.{field}"] = t.contiguous()
                metas.append({"layout": "layer", "fields": sorted(layer[0]), "meta": layer[1]})
                continue
            exported = held.export_rows()
            for h, head in enumerate(exported.heads):
                for field, t in head.items():
                    tensors[f"{l}.{h}.{field}"] = t.contiguous()
            metas.append({"layout": "heads", "fields": [sorted(head) for head in exported.heads], "meta": exported.meta})
        return tensors, {"layers": metas}

    def layer_count(self, meta: dict) -> int:
        return len(meta["layers"])

    def decode_layer(self, tensors: dict[str, Tensor], meta: dict, l: int) -> ExportedRows:
        from kvmem.quant import QuantizedRows

        layer, scheme = meta["layers"][l], self.scheme.for_layer(l)
        if layer.get("layout") == "layer":
            held = QuantizedRows.import_layer(scheme, {f: _tensor(tensors, f"{l}.{f}") for f in layer["fields"]},
                                              layer["meta"])
        elif layer.get("layout") == "heads":
            heads = [{f: _tensor(tensors, f"{l}.{h}.{f}") for f in fields} for h, fields in enumerate(layer["fields"])]
            held = QuantizedRows.import_encoded(scheme, ExportedRows(heads, self.scheme.spec, layer["meta"]))
        else:
            raise KVMemError(f"layer {l}: an unknown layout {layer.get('layout')!r}")
        stacked = held.stacked()  # every head decoded in one pass where they hold as many rows (a chunk)
        return (DenseExport(*stacked) if stacked is not None else
                ExportedRows([{"keys": k, "values": v, "positions": p} for k, v, p in held.heads()]))


def get_codec(spec: str) -> Codec:
    """`raw`, `quant:<scheme>` (e.g. `quant:kivi-8`) or `cachegen[:option=value...]`."""
    spec = spec.strip()
    if spec == "raw":
        return RawCodec()
    if spec.startswith("quant:"):
        return QuantCodec(spec.split(":", 1)[1])
    if spec == "cachegen" or spec.startswith("cachegen:"):
        return parse_cachegen(spec)
    raise KVMemError(f"unknown codec {spec!r}; available: raw, quant:<scheme> (e.g. quant:kivi-8), cachegen")

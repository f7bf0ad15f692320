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
`positions` (T,) int32 and optionally `log_weights` (T,). `decode` returns raw rows in the same form.
"""

from __future__ import annotations

import copy

from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme
from kvmem.rows import ExportedRows
from kvmem.store.cachegen import parse_cachegen
from kvmem.store.codec import Codec, _tensor


class RawCodec(Codec):
    name = "raw"
    lossless = True
    carries_encoded = True

    def encode(self, layers: list[ExportedRows]) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        encoded = []  # per layer: None (raw rows), or the codec, metadata and field names of rows held encoded
        for l, rows in enumerate(layers):
            for h, head in enumerate(rows.heads):
                for field, t in head.items():
                    tensors[f"{l}.{h}.{field}"] = t.contiguous()
            encoded.append(None if rows.codec == "raw" else
                           {"codec": rows.codec, "meta": rows.meta, "fields": [sorted(head) for head in rows.heads]})
        meta = {"heads": [len(r.heads) for r in layers], "weighted": [any("log_weights" in h for h in r.heads) for r in layers]}
        return tensors, meta | ({"encoded": encoded} if any(encoded) else {})

    def decode(self, tensors: dict[str, Tensor], meta: dict) -> list[ExportedRows]:
        fields = ("keys", "values", "positions")
        out = []
        encoded = meta.get("encoded") or [None] * len(meta["heads"])
        for l, (n_heads, weighted, held) in enumerate(zip(meta["heads"], meta["weighted"], encoded)):
            if held is not None:  # checked against the layer's scheme when imported (QuantizedRows.import_encoded)
                if len(held["fields"]) != n_heads:
                    raise KVMemError(f"layer {l}: {len(held['fields'])} heads of encoded fields, {n_heads} heads")
                heads = [{f: _tensor(tensors, f"{l}.{h}.{f}") for f in names} for h, names in enumerate(held["fields"])]
                out.append(ExportedRows(heads, held["codec"], held["meta"]))
                continue
            heads = []
            for h in range(n_heads):
                head = {f: _tensor(tensors, f"{l}.{h}.{f}") for f in fields + (("log_weights",) if weighted else ())}
                heads.append(head)
            out.append(ExportedRows(heads))
        return out


class QuantCodec(Codec):
    """Rows stored as a `kvmem.quant` scheme holds them (packed codes, scales, outliers), decoded on read."""

    name = "quant"

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
            exported = held.export_rows()
            for h, head in enumerate(exported.heads):
                for field, t in head.items():
                    tensors[f"{l}.{h}.{field}"] = t.contiguous()
            metas.append({"fields": [sorted(head) for head in exported.heads], "meta": exported.meta})
        return tensors, {"layers": metas}

    def decode(self, tensors: dict[str, Tensor], meta: dict) -> list[ExportedRows]:
        from kvmem.quant import QuantizedRows

        out = []
        for l, layer in enumerate(meta["layers"]):
            heads = [{f: _tensor(tensors, f"{l}.{h}.{f}") for f in fields} for h, fields in enumerate(layer["fields"])]
            held = QuantizedRows.import_encoded(self.scheme.for_layer(l), ExportedRows(heads, self.scheme.spec, layer["meta"]))
            out.append(ExportedRows([{"keys": k, "values": v, "positions": p} for k, v, p in held.heads()]))
        return out


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

"""A whole cache as one checksummed blob: what the batching scheduler writes when it preempts a row (its KV leaves
memory for a disk tier) and reads back when the row resumes.

Every layer's rows go out as `KVLayer.export_rows` gives them (raw, or still encoded by the layer's quantization
scheme: nothing is re-encoded, so a resumed row holds bit for bit what it held), with the layer's next position and
the model's fingerprint. `unpack_cache` verifies the frame's checksum, the fingerprint and the layer count before it
fills a fresh cache of the same method and scheme through `KVLayer.import_rows`, which checks the rows themselves.
"""

from __future__ import annotations

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.rows import ExportedRows
from kvmem.store import chunk

FORMAT = "kvmem-swap-1"


def pack_cache(cache: KVCache, fingerprint: str) -> bytes:
    tensors, layers = {}, []
    for l, layer in enumerate(cache.layers):
        rows = layer.export_rows()
        for h, head in enumerate(rows.heads):
            for name, t in head.items():
                tensors[f"{l}.{h}.{name}"] = t
        layers.append({"codec": rows.codec, "meta": rows.meta, "fields": [sorted(head) for head in rows.heads],
                       "next_position": layer.next_position})
    return chunk.pack(tensors, {"format": FORMAT, "model": fingerprint, "layers": layers})


def unpack_cache(blob: bytes, cache: KVCache, fingerprint: str) -> KVCache:
    """Fill `cache` (new, made like the packed one: same model, method and quantization) from `blob`."""
    tensors, header = chunk.unpack(blob)
    if header.get("format") != FORMAT or header.get("model") != fingerprint:
        raise KVMemError(f"swapped KV of format {header.get('format')!r} for model {str(header.get('model'))[:12]!r}; "
                         f"expected {FORMAT!r} for {fingerprint[:12]!r}")
    if len(header["layers"]) != len(cache.layers):
        raise KVMemError(f"swapped KV has {len(header['layers'])} layers; the model has {len(cache.layers)}")
    for l, (layer, saved) in enumerate(zip(cache.layers, header["layers"])):
        try:
            heads = [{name: tensors[f"{l}.{h}.{name}"] for name in fields} for h, fields in enumerate(saved["fields"])]
        except KeyError as e:
            raise KVMemError(f"swapped KV lacks tensor {e.args[0]}") from None
        layer.import_rows(ExportedRows(heads, saved["codec"], saved["meta"]), saved["next_position"])
    return cache

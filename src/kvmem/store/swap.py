"""A whole cache as one checksummed blob: what the batching scheduler writes when it preempts a row (its KV leaves
memory for a disk tier) and reads back when the row resumes.

Every layer's rows go out as `KVLayer.export_rows` gives them (raw, or still encoded by the layer's quantization
scheme: nothing is re-encoded, so a resumed row holds bit for bit what it held), with the layer's next position and
the model's fingerprint. `unpack_cache` verifies the frame's checksum, the fingerprint and the layer count before it
fills a fresh cache of the same method and scheme through `KVLayer.import_rows`, which checks the rows themselves.
A row that evicts as it decodes (a decode-phase method, moment-kv) also takes its tracked attention and its prompt's
end, so it resumes choosing rows as it would have.
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
        entry = {"codec": rows.codec, "meta": rows.meta, "fields": [sorted(head) for head in rows.heads],
                 "next_position": layer.next_position}
        seen = layer.observation
        if seen.head_attention is not None and seen.prompt_end is not None:  # a decode-phase row's momentum (moment-kv)
            entry["prompt_end"] = seen.prompt_end
            for h, a in enumerate(seen.head_attention):
                tensors[f"{l}.{h}.tracked_attention"] = a
        layers.append(entry)
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
            tracked = [tensors[f"{l}.{h}.tracked_attention"] for h in range(len(heads))] if "prompt_end" in saved else None
        except KeyError as e:
            raise KVMemError(f"swapped KV lacks tensor {e.args[0]}") from None
        layer.import_rows(ExportedRows(heads, saved["codec"], saved["meta"]), saved["next_position"])
        if tracked is not None:
            if [a.shape[-1] for a in tracked] != layer.lengths():
                raise KVMemError(f"swapped KV's tracked attention does not match its rows in layer {l}")
            layer.observation.head_attention, layer.observation.prompt_end = tracked, int(saved["prompt_end"])
    return cache

"""Encoded rows as named tensors plus JSON-able metadata, and back: how `QuantizedRows.export_rows` /
`import_encoded` move a scheme's encoded rows (any of the dataclasses below, nested) without decoding them."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvmem.errors import KVMemError

EXPORT_FORMAT = 1  # per head (`QuantizedRows.export_rows`)
LAYER_FORMAT = 2  # one set of tensors for a layer's heads (`QuantizedRows.export_layer`)


def flatten(obj, prefix: str, tensors: dict, meta: dict, types: dict[str, type]) -> None:
    """A dataclass of encoded rows as named tensors plus JSON-able metadata (nested dataclasses too). `types`: the
    encoded types the rows' scheme declares (`Scheme.encoded_types`), by name."""
    if types.get(type(obj).__name__) is not type(obj):
        raise KVMemError(f"{type(obj).__name__} rows cannot be exported")
    meta[f"{prefix}.__type"] = type(obj).__name__
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if isinstance(value, Tensor):
            tensors[key] = value.clone()
        elif dataclasses.is_dataclass(value):
            flatten(value, key, tensors, meta, types)
        elif isinstance(value, torch.dtype):
            meta[key] = {"dtype": str(value).split(".")[-1]}
        else:
            meta[key] = list(value) if isinstance(value, tuple) else value


def unflatten(prefix: str, tensors: dict, meta: dict, types: dict[str, type]):
    """The dataclass `flatten` wrote; only the types in `types` are ever rebuilt from stored metadata."""
    cls = types.get(meta.get(f"{prefix}.__type"))
    if cls is None:
        raise KVMemError(f"encoded rows name an unknown type {meta.get(f'{prefix}.__type')!r}")
    values = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        if key in tensors:
            values[f.name] = tensors[key]
        elif f"{key}.__type" in meta:
            values[f.name] = unflatten(key, tensors, meta, types)
        elif key in meta:
            v = meta[key]
            if isinstance(v, dict) and "dtype" in v:
                v = getattr(torch, v["dtype"])
            values[f.name] = tuple(v) if isinstance(v, list) else v
        else:
            raise KVMemError(f"encoded rows lack {key!r}")
    return cls(**values)


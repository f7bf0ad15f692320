"""Encoded rows as named tensors plus JSON-able metadata, and back: how `QuantizedRows.export_rows` /
`import_encoded` move a scheme's encoded rows (any of the dataclasses below, nested) without decoding them."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from kvmem.errors import KVMemError

EXPORT_FORMAT = 1


def _encoded_types() -> dict[str, type]:
    """The encoded row types an export may name (only these are ever rebuilt from stored metadata)."""
    from kvmem.quant.cq import Codes
    from kvmem.quant.kvquant import SparseCoded
    from kvmem.quant.pack import Quantized
    from kvmem.quant.rotatekv import WithSinks

    return {t.__name__: t for t in (Quantized, SparseCoded, WithSinks, Codes)}


def flatten(obj, prefix: str, tensors: dict, meta: dict) -> None:
    """A dataclass of encoded rows as named tensors plus JSON-able metadata (nested dataclasses too)."""
    if type(obj).__name__ not in _encoded_types():
        raise KVMemError(f"{type(obj).__name__} rows cannot be exported")
    meta[f"{prefix}.__type"] = type(obj).__name__
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}.{f.name}"
        if isinstance(value, Tensor):
            tensors[key] = value.clone()
        elif dataclasses.is_dataclass(value):
            flatten(value, key, tensors, meta)
        elif isinstance(value, torch.dtype):
            meta[key] = {"dtype": str(value).split(".")[-1]}
        else:
            meta[key] = list(value) if isinstance(value, tuple) else value


def unflatten(prefix: str, tensors: dict, meta: dict):
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
            values[f.name] = unflatten(key, tensors, meta)
        elif key in meta:
            v = meta[key]
            if isinstance(v, dict) and "dtype" in v:
                v = getattr(torch, v["dtype"])
            values[f.name] = tuple(v) if isinstance(v, list) else v
        else:
            raise KVMemError(f"encoded rows lack {key!r}")
    return cls(**values)


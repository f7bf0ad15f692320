"""The codec interface (`codecs.py` has the codecs and `get_codec`): one chunk's rows, every layer's `ExportedRows`,
as named tensors plus JSON metadata, and back, a layer at a time (layer l's tensors are named `l.*`: the frame verifies
each layer's tensors on their own, `chunk.py`); with the checks every decoder makes on what it reads."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.rows import ExportedRows


class Codec:
    name: ClassVar[str]
    version: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    carries_encoded: ClassVar[bool] = False  # stores rows a quantized layer exports encoded, and gives them back as such

    @property
    def spec(self) -> str:
        return self.name

    def for_model(self, lm) -> Codec:
        """This codec made ready for `lm` (a calibrated quantizer loads its artefacts)."""
        return self

    def encode(self, layers: list[ExportedRows]) -> tuple[dict[str, Tensor], dict]:
        raise NotImplementedError

    def layer_count(self, meta: dict) -> int:
        """How many layers a chunk of this codec holds, by its metadata (checked for consistency)."""
        raise NotImplementedError

    def decode_layer(self, tensors: dict[str, Tensor], meta: dict, l: int) -> ExportedRows:
        """Layer `l`'s rows, from its tensors (`l.*`) only: a reader verifies and decodes a chunk layer by layer."""
        raise NotImplementedError

    def decode(self, tensors: dict[str, Tensor], meta: dict) -> list[ExportedRows]:
        return [self.decode_layer(tensors, meta, l) for l in range(self.layer_count(meta))]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise KVMemError(f"chunk names an unknown dtype {name!r}")
    return dtype


def _tensor(tensors: dict[str, Tensor], key: str) -> Tensor:
    if key not in tensors:
        raise KVMemError(f"chunk lacks tensor {key!r}")
    return tensors[key]

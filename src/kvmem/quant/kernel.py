"""The decode-step attention kernel over packed codes (`attention.cpp`), built once per machine on first use.

`decode_attention(...)` computes one query token's attention over KIVI-style encoded rows plus a full-precision
residual without decoding the cache: the bytes a step reads are the codes (an eighth of float32 at 4 bits), where the
PyTorch path (`pack.dequantize` into a buffer, then SDPA) writes and reads a float32 copy of every row each step.
torch builds it with the system's C++ compiler and ninja into torch's extension cache (about a minute, once). Where it
cannot be built, `available()` is False, the reason is logged once, and layers decode through PyTorch as before (the
same arithmetic up to float summation order).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("attention.cpp")
_lock = threading.Lock()
_module = None
_failed: str | None = None


def _load():
    global _module, _failed
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("KVMEM_NO_KERNEL"):
            _failed = "KVMEM_NO_KERNEL is set"
            return None
        try:
            from torch.utils.cpp_extension import load

            # pip's ninja lives beside the interpreter, which need not be on PATH (a venv used without activation)
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            _module = load(name="kvmem_quant_attention", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, no ninja, no Python headers: PyTorch's path serves instead
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("kvmem: the quantized decode kernel could not be built (%s); quantized layers decode through "
                        "PyTorch", _failed)
        return _module


def available() -> bool:
    return _load() is not None


def decode_attention(query: Tensor, keys, values, offsets: Tensor, residual_keys: Tensor, residual_values: Tensor,
                     residual_offsets: Tensor, scaling: float) -> Tensor:
    """query (Hq, D) float32; keys, values: `Quantized` rows of every KV head joined along rows (`pack.concat`, keys
    grouped along rows, values along channels); offsets (H + 1,) int64: head h's rows are offsets[h]:offsets[h + 1];
    the residual rows (R, D) float32 with their offsets likewise. Returns (Hq, D)."""
    return _load().decode_attention(query, keys.packed, keys.scale, keys.zero, keys.bits, keys.group, values.packed,
                                    values.scale, values.zero, values.bits, values.group, offsets, residual_keys,
                                    residual_values, residual_offsets, scaling)

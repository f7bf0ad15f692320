"""The decode-step attention kernel over packed codes (`attention.cpp`), built once per machine on first use.

`decode_attention(...)` computes one query token's attention over KIVI-style encoded rows plus a full-precision
residual without decoding the cache, for every sequence of a batch in one call (parallel over sequences and heads:
one call per layer-row left 3 KV heads to 2 threads): the bytes a step reads are the codes (an eighth of float32 at
4 bits), where the PyTorch path (`pack.dequantize` into a buffer, then SDPA) writes and reads a float32 copy of every row each step.
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


def decode_attention(query: Tensor, keys: list, values: list, offsets: list[Tensor], residual_keys: list[Tensor],
                     residual_values: list[Tensor], scaling: float) -> Tensor:
    """A decode step of B sequences in one call, parallel over (sequence, KV head). query (B, Hq, D) float32; per
    sequence b: keys[b], values[b], its KV heads' `Quantized` rows joined along rows (`pack.concat`; all sequences at
    the same bits and groups), offsets[b] (H + 1,) int64 (head h's rows are offsets[h]:offsets[h + 1]); the residual
    rows (R, D) float32 of sequence b's head h at residual_keys[b * H + h] (and values). Returns (B, Hq, D)."""
    return _load().decode_attention(query, [k.packed for k in keys], [k.scale for k in keys], [k.zero for k in keys],
                                    keys[0].bits, keys[0].group, [v.packed for v in values], [v.scale for v in values],
                                    [v.zero for v in values], values[0].bits, values[0].group, offsets, residual_keys,
                                    residual_values, scaling)

"""The decode-step kernels (`kernel.cpp`, `linear.cpp`), built once per machine on first use.

`decode_attention(query, rows, scaling)` computes one query token's attention for every sequence of a batch in one
call, parallel over (sequence, KV head), each query head over the rows its KV head holds, all visible (no mask):

* KIVI-style encoded rows (`kvmem.quant.kivi`), read as codes in place: the bytes a step reads are the codes (an
  eighth of float32 at 4 bits), where PyTorch's path (`pack.dequantize` into a buffer, then SDPA) writes and reads
  a float32 copy of every row each step;
* full-precision rows: a quantized layer's residual, or an evicted layer's heads of different lengths, which SDPA
  would read head by head (one call each, on one thread).

`few_rows_linear(x, weight)` is a decode step's linear layer for up to 64 rows (`models.FewRowsLinear`): one read
of the weights for every row, where MKL's GEMM for a few rows costs several (see `linear.cpp`).

One call per batch rather than per sequence keeps both threads busy (one sequence's 3 KV heads left one idle half
the time). torch builds it with the system's C++ compiler and ninja into torch's extension cache (about 30 s, once).
Where it cannot be built, `available()` is False, the reason is logged once, and layers attend through PyTorch as
before (the same arithmetic up to float summation order).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from torch import Tensor

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name("kernel.cpp"), Path(__file__).with_name("linear.cpp")]
_lock = threading.Lock()
_module = None
_failed: str | None = None


def _load():
    global _module, _failed
    if _module is not None:  # built: no lock (asked in every decode step)
        return _module
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
            _module = load(name="kvmem_decode_attention", sources=[str(s) for s in SOURCES],
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
                           build_directory=str(_build_directory()))
        except Exception as e:  # no compiler, no ninja, no Python headers: PyTorch's path serves instead
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("kvmem: the decode kernel could not be built (%s); layers attend through PyTorch", _failed)
        return _module


STALE_LOCK_S = 600  # a build takes ~30 s (minutes on a loaded machine); a lock this old was left by a killed build


def _build_directory() -> Path:
    """One build folder per checkout and source text: checkouts side by side (git worktrees, CI) would otherwise
    rebuild in turn, each rewriting the shared build file with its own source paths. A lock left by a build that was
    killed makes torch wait forever, so one older than STALE_LOCK_S is removed."""
    import hashlib
    import time

    from torch.utils.cpp_extension import _get_build_directory

    digest = hashlib.blake2b(digest_size=8)
    for source in SOURCES:
        digest.update(str(source).encode() + b"\0" + source.read_bytes())
    folder = Path(_get_build_directory("kvmem_decode_attention", verbose=False)).parent / f"kvmem_kernel_{digest.hexdigest()}"
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        log.warning("kvmem: removing a stale kernel build lock (%s)", lock)
        lock.unlink(missing_ok=True)
    return folder


def available() -> bool:
    return _load() is not None


def few_rows_linear(x: Tensor, weight: Tensor) -> Tensor:
    """x (N, in) @ weight (out, in).T for 1 <= N <= 64, float32 on the CPU; needs `available()`."""
    return _load().few_rows_linear(x, weight)


def decode_attention(query: Tensor, rows: list, scaling: float) -> Tensor:
    """query (B, Hq, D) float32; rows[b] the b-th sequence's `kvmem.rows.KernelRows`: its KV heads' encoded rows
    joined along rows (`Quantized`, `pack.concat`; head h's at offsets[h]:offsets[h + 1]; every sequence at the same
    bits and groups) or None for every sequence (full-precision rows only), and per head its full-precision rows
    (R, D) float32 (of which the first `residual_rows[h]` are read, where given). Returns (B, Hq, D)."""
    coded = [r for r in rows if r.keys is not None]
    if coded and len(coded) != len(rows):
        raise ValueError("one decode_attention call takes sequences with codes or sequences without, not both")
    keys, values = [r.keys for r in coded], [r.values for r in coded]
    k0, v0 = (keys[0], values[0]) if coded else (None, None)
    return _load().decode_attention(query, [k.packed for k in keys], [k.scale for k in keys], [k.zero for k in keys],
                                    k0.bits if k0 else 8, k0.group if k0 else 1, [v.packed for v in values],
                                    [v.scale for v in values], [v.zero for v in values], v0.bits if v0 else 8,
                                    v0.group if v0 else query.shape[-1], [r.offsets for r in coded],
                                    [k for r in rows for k in r.residual_keys],
                                    [v for r in rows for v in r.residual_values],
                                    [n for r in rows for n in (r.residual_rows or (k.shape[0] for k in r.residual_keys))],
                                    scaling)

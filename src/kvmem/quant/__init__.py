"""KV quantization: packed low-bit row storage behind the `Rows` contract, one file per scheme.

`get_scheme("kivi-2")` or `get_scheme("kivi-4:group=64")`; `KVCache(config, quant=get_scheme("kivi-2"))` holds every
layer's rows that way (see `base.py`). Bit-packing and group quantization are in `pack.py`.
"""

from __future__ import annotations

from kvmem.quant.adaquant import AdaQuant
from kvmem.quant.base import QuantizedRows, Scheme
from kvmem.quant.cq import CoupledQuantization
from kvmem.quant.kivi import KIVI
from kvmem.quant.kvquant import KVQuant
from kvmem.quant.mikv import MiKV
from kvmem.quant.rotatekv import RotateKV
from kvmem.spec import check_options, parse_spec

SCHEMES = {f"kivi-{bits}": (KIVI, {"bits": bits}) for bits in (8, 4, 3, 2)}
SCHEMES |= {f"kvquant-{bits}": (KVQuant, {"bits": bits}) for bits in (4, 3, 2)}
SCHEMES |= {f"adaquant-k{k}v{v}": (AdaQuant, {"key_bits": k, "value_bits": v}) for k, v in ((4, 2), (2, 4))}
SCHEMES |= {f"rotatekv-{bits}": (RotateKV, {"bits": bits}) for bits in (4, 3, 2)}
SCHEMES |= {f"cq-{bits}": (CoupledQuantization, {"bits": bits}) for bits in (2, 1)}
SCHEMES |= {"mikv": (MiKV, {})}  # mixed precision: what eviction drops is kept at low bits


def get_scheme(spec: str, lm=None) -> Scheme:
    """The scheme named by `spec`; with `lm` (a kvmem.models.LoadedModel), prepared for it (a calibrated
    scheme loads or fits its artefacts)."""
    name, options = parse_spec(spec, SCHEMES, "quantization scheme")
    cls, fixed = SCHEMES[name]
    check_options(name, cls, options, skip=tuple(fixed))
    scheme = cls(**fixed, **options)
    return scheme.prepare(lm) if lm is not None else scheme


__all__ = ["SCHEMES", "QuantizedRows", "Scheme", "get_scheme"]

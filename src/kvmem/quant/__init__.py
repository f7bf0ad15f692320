"""KV quantization: packed low-bit row storage behind the `Rows` contract, one file per scheme.

`get_scheme("kivi-2")` or `get_scheme("kivi-4:group=64")`; `KVCache(config, quant="kivi-2")` holds every
layer's rows that way (see `base.py`). Bit-packing and group quantization are in `pack.py`.
"""

from __future__ import annotations

from kvmem.errors import KVMemError
from kvmem.quant.base import QuantizedRows, Scheme
from kvmem.quant.kivi import KIVI
from kvmem.spec import check_options, parse_spec

SCHEMES = {f"kivi-{bits}": (KIVI, {"bits": bits}) for bits in (8, 4, 3, 2)}


def get_scheme(spec: str) -> Scheme:
    name, options = parse_spec(spec, SCHEMES, "quantization scheme")
    cls, fixed = SCHEMES[name]
    check_options(name, cls, options, skip=tuple(fixed))
    return cls(**fixed, **options)


__all__ = ["SCHEMES", "QuantizedRows", "Scheme", "get_scheme"]

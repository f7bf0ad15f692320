"""`adaquant-k4v2` (and the reverse, `adaquant-k2v4`): KV-AdaQuant, more bits for keys than for values.

"More for Keys, Less for Values: Adaptive KV Cache Quantization" (KV-AdaQuant, arXiv 2502.15075). Key
matrices have larger norms and spectral norms than value matrices, so their quantization error is amplified
more; at the same total budget, 4-bit keys with 2-bit values beat the reverse. The quantizer is KIVI's
(keys per channel, values per token, asymmetric groups, a full-precision recent window); only the bit split
is new. `adaquant-k2v4` is the reverse assignment, kept to show the asymmetry.
"""

from __future__ import annotations

from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.kivi import KIVI
from kvmem.quant.pack import Quantized, quantize


class AdaQuant(KIVI):
    def __init__(self, key_bits: int, value_bits: int, group: int = 32, residual: int = 128):
        if {key_bits, value_bits} - {8, 4, 3, 2}:
            raise KVMemError(f"adaquant takes 8, 4, 3 or 2 bits for keys and values; got K{key_bits} V{value_bits}")
        super().__init__(max(key_bits, value_bits), group, residual)
        self.key_bits, self.value_bits = key_bits, value_bits
        self.bits = (key_bits + value_bits) / 2
        self.name = f"adaquant-k{key_bits}v{value_bits}"

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[Quantized, Quantized]:
        return quantize(keys, self.key_bits, self.group, dim=0), quantize(values, self.value_bits, self.group, dim=1)

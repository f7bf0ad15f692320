"""`kivi-{8,4,3,2}`: KIVI, tuning-free asymmetric quantization of the KV cache.

Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (arXiv 2402.02750).
Keys have outlier *channels*, so they are quantized per channel: each group is `group` tokens of one
channel. Values have no such structure and are quantized per token: each group is `group` channels of
one token. Both asymmetric (min-max, a scale and a zero-point per group). The newest `residual` tokens
(R, a multiple of the group) stay in full precision, and so do older ones until they fill a group, so keys
can be grouped along tokens. Defaults as the paper's main setting: G = 32, R = 128.
"""

from __future__ import annotations

from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme, encoded_rows
from kvmem.quant.pack import Quantized, concat, dequantize, quantize, split, stack, unstack
from kvmem.spec import format_spec


class KIVI(Scheme):
    def __init__(self, bits: int, group: int = 32, residual: int = 128):
        if bits not in (8, 4, 3, 2) or group < 1 or residual < 0 or residual % group:
            raise KVMemError(f"kivi takes 8, 4, 3 or 2 bits, a group >= 1 and a residual that is a multiple of it; "
                             f"got {bits} bits, group {group}, residual {residual}")
        self.bits, self.group, self.residual = bits, group, residual
        self.name = f"kivi-{bits}"

    def check(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise KVMemError(f"{self.spec}: head_dim {head_dim} is not a multiple of the group {self.group} "
                             f"(values are grouped along channels); choose e.g. {self.name}:group={head_dim // 2 or 1}")

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[Quantized, Quantized]:
        return quantize(keys, self.bits, self.group, dim=0), quantize(values, self.bits, self.group, dim=1)

    def decode(self, keys: Quantized, values: Quantized, positions: Tensor, head: int) -> tuple[Tensor, Tensor]:
        return dequantize(keys), dequantize(values)

    def encode_heads(self, keys: Tensor, values: Tensor, positions: Tensor) -> list[tuple[Quantized, Quantized]]:
        """Every head (H, n, D) in one quantization per K and V (the same groups, so the same codes, as head by head)."""
        if type(self).encode is not KIVI.encode:  # a variant that encodes otherwise
            return super().encode_heads(keys, values, positions)
        return list(zip(unstack(quantize(keys, self.bits, self.group, dim=1)),
                        unstack(quantize(values, self.bits, self.group, dim=2))))

    def join_heads(self, parts: list[Quantized | None], stacked: bool) -> Quantized | None:
        if stacked:
            return stack(parts) if encoded_rows(parts) else None
        # keys' groups run along rows and every head's encoded rows fill whole groups: heads concatenate group-aligned
        held = [p for p in parts if p is not None]
        return concat(held, 0) if held else None

    def split_heads(self, joined: Quantized, counts: list[int], stacked: bool) -> list[Quantized | None]:
        return unstack(joined) if stacked else split(joined, counts)

    def decode_joined(self, keys: Quantized, values: Quantized, positions: Tensor, out_keys: Tensor,
                      out_values: Tensor) -> None:
        dequantize(keys, out_keys)
        dequantize(values, out_values)

    def has_decode_kernel(self, head_dim: int) -> bool:
        from kvmem import kernel

        # the kernel reads a value group's codes per byte slot: the group must hold whole bytes of codes
        value_bits = getattr(self, "value_bits", self.bits)
        per_byte = 8 // value_bits if 8 % value_bits == 0 else 1
        return head_dim % 8 == 0 and head_dim % self.group == 0 and self.group % per_byte == 0 and kernel.available()

    def decode_attention(self, query: Tensor, rows: list, scaling: float) -> Tensor:
        from kvmem import kernel

        return kernel.decode_attention(query, rows, scaling)

    @property
    def spec(self) -> str:
        return format_spec(self.name, {k: v for k, v in (("group", self.group), ("residual", self.residual))
                                       if v != {"group": 32, "residual": 128}[k]})

"""Bit-packing and asymmetric group quantization: the bytes a quantized cache really holds.

`pack(codes, bits)` stores integer codes in [0, 2^bits) at `bits` bits each along the last dimension
(8 codes in `bits` bytes, so 3-bit codes take 3/8 of a byte, not one byte); `unpack` inverts it exactly.

`quantize(x, bits, group, dim)` is min-max asymmetric quantization in groups of `group` elements along
`dim` (KIVI quantizes keys per channel: groups run along tokens; values per token: groups run along
channels). Each group keeps a float16 scale and zero-point. `dequantize` returns x up to half a step
per element: |x - dequantize(quantize(x))| <= scale / 2 (plus float16 rounding of scale and zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.errors import KVMemError

BITS = (1, 2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise KVMemError(f"{bits}-bit codes are not supported; choose from {', '.join(map(str, BITS))}")


def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 (..., ceil(n / 8) * bits) holding the codes (..., n) at `bits` bits each (n padded to a multiple of 8)."""
    _check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.shape[-1]
    pad = (-n) % 8
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).reshape(*codes.shape[:-1], -1, 8)
    word = (c << (torch.arange(8, device=c.device) * bits)).sum(-1)  # 8 codes in 8 * bits <= 32 bits
    out = (word[..., None] >> (torch.arange(bits, device=c.device) * 8)) & 0xFF
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """The first `n` codes (..., n) as uint8, from `pack`'s output."""
    _check_bits(bits)
    if bits == 8:
        return packed[..., :n]
    if 8 % bits == 0:  # whole codes per byte (1, 2, 4 bits): byte j holds codes j*8/bits.. at increasing shifts
        # one whole-tensor shift per code slot, then interleaved (faster on CPU than one broadcast shift); the lowest
        # slot needs no shift and the highest no mask
        mask = (1 << bits) - 1
        codes = torch.stack([packed & mask if s == 0 else packed >> s if s == 8 - bits else (packed >> s) & mask
                             for s in range(0, 8, bits)], dim=-1)
        return codes.reshape(*packed.shape[:-1], -1)[..., :n]
    b = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, bits)
    word = (b << (torch.arange(bits, device=b.device) * 8)).sum(-1)
    codes = (word[..., None] >> (torch.arange(8, device=b.device) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


@dataclass
class Quantized:
    """Packed codes plus one float16 scale and zero-point per group; what is held, byte for byte.
    Codes keep x's layout (packed along its last dim); scales and zero-points are laid out with the
    grouped dim moved last: (..., groups)."""

    packed: Tensor  # uint8, x's codes packed along x's last dim
    scale: Tensor  # float16 (..., groups)
    zero: Tensor  # float16 (..., groups)
    bits: int
    group: int
    dim: int  # the dimension of x the groups run along
    shape: tuple[int, ...]  # x's shape
    dtype: torch.dtype

    def tensors(self) -> list[Tensor]:
        return [self.packed, self.scale, self.zero]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def check(self) -> None:
        """Raise a KVMemError unless the tensors hold what the fields say (rows read back from storage: the codes packed
        at `bits` along the last dim, one uint8 per byte; float16 scales and zero-points (..., groups) along `dim`)."""
        shape, nd = tuple(self.shape), len(self.shape)
        if self.bits not in BITS or self.group < 1 or not 0 <= self.dim < nd or shape[self.dim] % self.group:
            raise KVMemError(f"quantized rows of {self.bits} bits in groups of {self.group} along dim {self.dim} cannot "
                             f"hold {shape}")
        packed = (*shape[:-1], shape[-1] if self.bits == 8 else -(-shape[-1] // 8) * self.bits)
        groups = (*shape[:self.dim], *shape[self.dim + 1:], shape[self.dim] // self.group)
        if self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != packed:
            raise KVMemError(f"packed codes {tuple(self.packed.shape)} {self.packed.dtype}; {shape} at {self.bits} bits "
                             f"packs into {packed} uint8")
        for name, t in (("scales", self.scale), ("zero-points", self.zero)):
            if t.dtype != torch.float16 or tuple(t.shape) != groups:
                raise KVMemError(f"{name} {tuple(t.shape)} {t.dtype}; {shape} in groups of {self.group} along dim "
                                 f"{self.dim} has {groups} float16")

    # -- the `Encoded` contract of kvmem.quant.base: rows along dim 0 --
    @property
    def rows(self) -> int:
        return self.shape[0]

    def cat(self, later: Quantized) -> Quantized:
        return concat([self, later], 0)

    def drop(self, n: int) -> Quantized:
        """Rows `n:` (n a multiple of the group when groups run along rows)."""
        if self.dim == 0 and n % self.group:
            raise KVMemError(f"cannot drop {n} rows of groups of {self.group} rows")
        scale_rows = (slice(None), slice(n // self.group, None)) if self.dim == 0 else (slice(n, None),)
        return Quantized(self.packed[n:].clone(), self.scale[scale_rows].clone(), self.zero[scale_rows].clone(),
                         self.bits, self.group, self.dim, (self.shape[0] - n, *self.shape[1:]), self.dtype)


def quantize(x: Tensor, bits: int, group: int, dim: int = -1) -> Quantized:
    """Min-max asymmetric quantization of x in groups of `group` consecutive elements along `dim`
    (x.shape[dim] must be a multiple of `group`)."""
    _check_bits(bits)
    dim = dim % x.dim()
    if group < 1 or x.shape[dim] % group:
        raise KVMemError(f"cannot quantize {x.shape[dim]} elements along dim {dim} in groups of {group}")
    moved = x.movedim(dim, -1).float()
    g = moved.reshape(*moved.shape[:-1], -1, group)  # (..., groups, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / ((1 << bits) - 1)).to(torch.float16)
    zero = lo.to(torch.float16)
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    codes = ((g - zero.float()[..., None]) / s).round_().clamp_(0, (1 << bits) - 1)
    codes = codes.reshape(moved.shape).movedim(-1, dim)
    return Quantized(pack(codes, bits), scale, zero, bits, group, dim, tuple(x.shape), x.dtype)


def dequantize(q: Quantized, out: Tensor | None = None) -> Tensor:
    """x from its quantized form, written into `out` (x's shape) when given."""
    codes = unpack(q.packed, q.bits, q.shape[-1])
    nd = len(q.shape)
    if nd >= 2 and q.dim >= nd - 2:  # rows (..., T, D), the cache's case: one multiply and one add, no moved copies
        *lead, t, d = q.shape
        if q.dim == nd - 2:  # groups of `group` rows per channel; scale (..., D, T / group), made contiguous
            codes = codes.view(*lead, t // q.group, q.group, d)
            scale, zero = (z.transpose(-1, -2).float().contiguous()[..., None, :] for z in (q.scale, q.zero))
        else:  # groups of `group` channels per row; scale (..., T, D / group)
            codes = codes.view(*lead, t, d // q.group, q.group)
            scale, zero = q.scale.float()[..., None], q.zero.float()[..., None]
        direct = out is not None and out.dtype == torch.float32
        x = torch.mul(codes, scale, out=out.view(codes.shape) if direct else None).add_(zero)  # uint8 codes read once
        if direct:
            return out
        x = x.view(q.shape).to(q.dtype)
    else:
        codes = codes.to(torch.float32).movedim(q.dim, -1)
        x = codes.reshape(*codes.shape[:-1], -1, q.group) * q.scale.float()[..., None] + q.zero.float()[..., None]
        x = x.reshape(codes.shape).movedim(-1, q.dim).to(q.dtype)
    return x if out is None else out.copy_(x)


def stack(parts: list[Quantized]) -> Quantized:
    """Quantized tensors of one shape stacked along a new leading dim (as torch.stack of the x's)."""
    first = parts[0]
    if any((p.bits, p.group, p.dim, p.shape) != (first.bits, first.group, first.dim, first.shape) for p in parts):
        raise KVMemError("stacked quantized parts must share bits, group, grouped dim and shape")
    return Quantized(torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]),
                     torch.stack([p.zero for p in parts]), first.bits, first.group, first.dim + 1,
                     (len(parts), *first.shape), first.dtype)


def unstack(stacked: Quantized) -> list[Quantized]:
    """`stack`'s parts back, as views of the stacked tensors (nothing copied)."""
    return [Quantized(stacked.packed[i], stacked.scale[i], stacked.zero[i], stacked.bits, stacked.group, stacked.dim - 1,
                      stacked.shape[1:], stacked.dtype) for i in range(stacked.shape[0])]


def split(joined: Quantized, counts: list[int]) -> list[Quantized | None]:
    """`concat(parts, 0)`'s parts back (`counts[i]` rows each; None for 0), as views of the joined tensors."""
    out, start = [], 0
    for n in counts:
        if not n:
            out.append(None)
            continue
        if joined.dim == 0:  # groups of `group` rows: the scales' last dim runs along row groups
            scale, zero = (z[..., start // joined.group:(start + n) // joined.group] for z in (joined.scale, joined.zero))
        else:
            scale, zero = joined.scale[start:start + n], joined.zero[start:start + n]
        out.append(Quantized(joined.packed[start:start + n], scale, zero, joined.bits, joined.group, joined.dim,
                             (n, *joined.shape[1:]), joined.dtype))
        start += n
    return out


def concat(parts: list[Quantized], dim: int) -> Quantized:
    """The quantized tensors joined along `dim` of x (not the packed last dim), groups kept as they are."""
    first = parts[0]
    dim = dim % len(first.shape)
    if dim == len(first.shape) - 1 or any((p.bits, p.group, p.dim) != (first.bits, first.group, first.dim) for p in parts):
        raise KVMemError("quantized parts join along a leading dim and must share bits, group and grouped dim")
    scale_dim = -1 if dim == first.dim else (dim if dim < first.dim else dim - 1)  # in the moved layout
    shape = list(first.shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return Quantized(torch.cat([p.packed for p in parts], dim), torch.cat([p.scale for p in parts], scale_dim),
                     torch.cat([p.zero for p in parts], scale_dim), first.bits, first.group, first.dim, tuple(shape),
                     first.dtype)


def _demo() -> None:
    x = torch.randn(4, 64, 32)
    for bits in BITS:
        q = quantize(x, bits, 32, dim=1)
        err = (dequantize(q) - x).abs().max().item()
        print(f"{bits}-bit: {q.nbytes} bytes for {x.numel() * 4} in float32, max error {err:.3f}")


if __name__ == "__main__":
    _demo()

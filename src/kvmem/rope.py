"""RoPE helpers: rotate keys or queries to positions, undo it, or move cached keys to new positions.

transformers applies RoPE as `x * cos + rotate_half(x) * sin` with angles `position * inv_freq` (each
frequency used twice, for the two halves of head_dim). A kvmem cache stores keys after RoPE at their
original positions. Scorers that model queries before RoPE (expected-attention), quantizers that work on
pre-RoPE keys, and chunk reuse (a stored chunk placed at another offset) need the rotation as a function:

    k_pre  = unrotate(k, positions, inv_freq)
    k_here = move(k, positions, new_positions, inv_freq)   # = rotate(k_pre, new_positions, inv_freq)

A rotation is linear, so any scalar the model folds into cos and sin (`attention_scaling` of some RoPE
variants) stays on the key through `move`; `rotate`/`unrotate` are the pure rotations.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from kvmem.errors import KVMemError


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rope_frequencies(model, layer: int) -> Tensor:
    """Inverse frequencies (head_dim/2,) of the rotary embedding `layer` uses (per layer type on Gemma 3)."""
    rotary = model.model.rotary_emb
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    freq = getattr(rotary, f"{layer_types[layer]}_inv_freq", None) if layer_types else None
    freq = freq if freq is not None else getattr(rotary, "inv_freq", None)
    if freq is None:
        raise KVMemError(f"{type(model).__name__}: no rotary frequencies found; this needs a RoPE model")
    return freq.float()


def angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin (*positions.shape, head_dim) of the rotation at each position (positions (T,), or (H, T): one
    row per head)."""
    angle = positions.float()[..., None] * inv_freq.float()  # in float32, as transformers computes them
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, in x's dtype (x (..., T, D); cos, sin broadcast to it)."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class _LastAngles(threading.local):
    """The last angles `rotate` computed, per thread: a quantizer of pre-RoPE keys rotates every head of every
    layer to the same positions at each decode step, and they change only when a block is encoded. Only
    tables up to MEMO_ELEMENTS are kept, so an idle thread holds at most 2 x 16 MiB."""

    positions: Tensor | None = None
    inv_freq: Tensor | None = None
    cos_sin: tuple[Tensor, Tensor] | None = None


_last = _LastAngles()
MEMO_ELEMENTS = 1 << 22  # positions x head_dim of the largest table remembered


def rotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """RoPE at `positions` applied to x (..., T, D): positions (T,), or (H, T) for x (H, T, D) whose heads hold
    rows of other positions."""
    last = _last
    if not (last.positions is not None and last.positions.shape == positions.shape and last.inv_freq.shape == inv_freq.shape
            and last.positions.device == positions.device and torch.equal(last.positions, positions)
            and torch.equal(last.inv_freq, inv_freq)):
        cos_sin = angles(positions, inv_freq)
        if positions.numel() * 2 * inv_freq.numel() > MEMO_ELEMENTS:
            return apply_rotation(x, *cos_sin)
        last.cos_sin, last.positions, last.inv_freq = cos_sin, positions.clone(), inv_freq.clone()
    return apply_rotation(x, *last.cos_sin)


def unrotate(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """The inverse of `rotate`: x (..., T, D) rotated back from `positions` to before RoPE."""
    cos, sin = angles(positions, inv_freq)
    return apply_rotation(x, cos, -sin)


def move(x: Tensor, from_positions: Tensor, to_positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Keys rotated at `from_positions` re-rotated to `to_positions` (one rotation by the difference)."""
    if from_positions.shape != to_positions.shape:
        raise KVMemError(f"move: {from_positions.numel()} source positions for {to_positions.numel()} targets")
    return rotate(x, to_positions.long() - from_positions.long(), inv_freq)


def _demo() -> None:
    """Round trip and composition on a random key."""
    freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    k, p = torch.randn(5, 8), torch.tensor([0, 3, 7, 100, 4000])
    assert torch.allclose(unrotate(rotate(k, p, freq), p, freq), k, atol=1e-5)
    assert torch.allclose(move(rotate(k, p, freq), p, p + 17, freq), rotate(k, p + 17, freq), atol=1e-4)


if __name__ == "__main__":
    _demo()
    print("rope: round trip and move agree")

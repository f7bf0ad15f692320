"""`rotatekv-{2,3,4}`: RotateKV, Hadamard-rotated 2-bit KV quantization with outlier-aware channel order.

Su et al. 2025, "RotateKV: Accurate and Robust 2-Bit KV Cache Quantization for LLMs via Outlier-Aware
Adaptive Rotations" (arXiv 2501.16383; abstract in shared/seeds; reference code github.com/ZunhaiSu/RotateKV,
whose steps are followed here where the abstract is silent):

- Pre-RoPE rotation. A key is taken back before RoPE (`rope.unrotate` at its position), rotated by the
  orthonormal Walsh-Hadamard transform (a plain-torch FWHT, `fwht`), and rotated back to its position after
  decoding: RoPE mixes channel pairs differently at every position, so the channel statistics the order
  relies on only hold before it.
- Outlier-aware channel order. After the Hadamard, a key's channels still carry distinct offsets (an outlier
  channel becomes a +-pattern over all channels). The channels are sorted by their mean over calibration
  keys (the authors' `k_reordering_calibration.py`), so each per-token quantization group holds channels of
  similar offset; the order is fitted once per layer and KV head (`prepare`, cached with `load_or_fit`).
  The reference applies FWHT, then the order; so does this.
- Per-token quantization, keys and values. Rotated keys are quantized per token in groups of `group`
  consecutive (reordered) channels, like values; values are Hadamard-rotated too (the reference fuses that
  rotation into v_proj / o_proj). Asymmetric min-max with the reference's clipping: each group's range is
  scaled by `clip` (0.8 at 2 bits as in its RotateKV2 setting, 1 otherwise).
- Attention-sink-aware. The paper keeps the tokens holding massive activations (the top-20 |h| elements of
  the residual stream) in full precision. A cache sees only K and V, where those tokens stand out by their
  near-zero values; per layer and head a value-norm threshold is fitted on calibration text to best
  reproduce the paper's massive-activation tokens (`sink_threshold`), and the first token is always kept.
  Sink rows are held exactly (`WithSinks`), so the bytes held count them.

Deviations, forced by kvmem's layout: the paper's *grouped-head* rotation (one Hadamard over several KV
heads) and its order across the heads of a layer are not possible here, since kvmem holds each KV head's rows
separately and, after eviction, heads hold different rows; rotation and order are within one head (head_dim
must be a power of two). The paper keeps no recent window in full precision (`residual` defaults to 0);
like every kvmem scheme, the newest rows that do not fill a block of `group` stay full precision until they do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme, encoded_rows
from kvmem.quant.pack import Quantized, dequantize, quantize, stack
from kvmem.rope import rope_frequencies, rotate, unrotate
from kvmem.spec import format_spec


def fwht(x: Tensor) -> Tensor:
    """The orthonormal Walsh-Hadamard transform of x along its last dim (a power of two), in float32: x @ H
    with H the Sylvester Hadamard matrix / sqrt(d). H is symmetric and orthogonal, so fwht(fwht(x)) == x."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise KVMemError(f"the Walsh-Hadamard transform needs a power-of-two size; got {d}")
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:  # butterflies: (i, i + h) -> (a + b, a - b)
        y = y.reshape(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) / math.sqrt(d)


def hadamard(d: int) -> Tensor:
    """The explicit orthonormal Sylvester Hadamard matrix of size d (for tests and checks; `fwht` is the fast way)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise KVMemError(f"no Sylvester Hadamard matrix of size {d} (not a power of two)")
    return h / math.sqrt(d)


@dataclass
class WithSinks:
    """Encoded rows: every row's codes, plus the sink rows held exactly (they replace their decoded rows)."""

    codes: Quantized
    index: Tensor  # int32 (s,): the sink rows among these rows, increasing
    exact: Tensor  # (s, D): those rows as they were given

    @property
    def rows(self) -> int:
        return self.codes.rows

    def tensors(self) -> list[Tensor]:
        return [*self.codes.tensors(), self.index, self.exact]

    def cat(self, later: WithSinks) -> WithSinks:
        return WithSinks(self.codes.cat(later.codes), torch.cat([self.index, later.index + self.rows]),
                         torch.cat([self.exact, later.exact]))

    def drop(self, n: int) -> WithSinks:
        kept = self.index >= n
        return WithSinks(self.codes.drop(n), (self.index[kept] - n).clone(), self.exact[kept].clone())


class RotateKV(Scheme):
    calibrated = True
    encoded_types = (WithSinks, Quantized)

    def __init__(self, bits: int, group: int = 32, residual: int = 0, clip: float | None = None,
                 pre_rope: bool = True, sinks: bool = True, sequences: int = 2, length: int = 512):
        if bits not in (4, 3, 2) or group < 1 or residual < 0 or residual % group:
            raise KVMemError(f"rotatekv takes 4, 3 or 2 bits, a group >= 1 and a residual that is a multiple of it; "
                             f"got {bits} bits, group {group}, residual {residual}")
        if clip is not None and not 0 < clip <= 1:
            raise KVMemError(f"rotatekv: clip scales each group's range and must be in (0, 1]; got {clip}")
        if min(sequences, length) < 1:
            raise KVMemError(f"rotatekv calibrates on sequences x length tokens, both >= 1; got {sequences} x {length}")
        self.bits, self.group, self.residual = bits, group, residual
        self.clip_option = clip
        self.clip = clip if clip is not None else (0.8 if bits == 2 else 1.0)  # the reference's RotateKV2/3/4
        self.pre_rope, self.sinks, self.sequences, self.length = pre_rope, sinks, sequences, length
        self.name = f"rotatekv-{bits}"
        self.fitted: dict[str, Tensor] | None = None  # per layer: channel order (heads, D), sink threshold (heads,)
        self.inv_freqs: list[Tensor] | None = None
        self.layer: int | None = None  # set on a layer's view (`for_layer`)

    # -- calibration ----------------------------------------------------------------------------------
    def check(self, head_dim: int) -> None:
        if head_dim < 1 or head_dim & (head_dim - 1):
            raise KVMemError(f"{self.spec}: head_dim {head_dim} is not a power of two, which the fast Walsh-Hadamard "
                             "transform needs (kvmem rotates within one head)")
        if head_dim % self.group:
            raise KVMemError(f"{self.spec}: head_dim {head_dim} is not a multiple of the group {self.group} (keys and "
                             f"values are grouped along channels); choose e.g. {self.name}:group={head_dim // 2 or 1}")

    def prepare(self, lm) -> RotateKV:
        config = lm.model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check(head_dim)  # before fitting anything
        fitted = load_or_fit_rotatekv(lm, dict(sequences=self.sequences, length=self.length, top=20))
        layers = config.num_hidden_layers
        if any(f"layer.{i}.order" not in fitted for i in range(layers)) or fitted["layer.0.order"].shape[-1] != head_dim:
            raise KVMemError(f"{self.spec}: the fitted channel order does not match {lm.name}'s layers or heads")
        out = self._copy()
        out.fitted = fitted
        out.inv_freqs = [rope_frequencies(lm.model, i).cpu() for i in range(layers)] if self.pre_rope else None
        return out

    @property
    def ready(self) -> bool:
        return self.fitted is not None

    def for_layer(self, layer: int) -> RotateKV:
        if self.fitted is None:
            raise KVMemError(f"{self.spec} is fitted per model: make it with kvmem.quant.get_scheme('{self.spec}', lm)")
        view = self._copy()
        view.fitted, view.inv_freqs, view.layer = self.fitted, self.inv_freqs, layer
        key = f"layer.{layer}.order" if self.pre_rope else f"layer.{layer}.order_post"
        view.order = self.fitted[key].long()  # (heads, D): stored channel j is rotated channel order[j]
        view.inverse = view.order.argsort(-1)
        view.threshold = self.fitted[f"layer.{layer}.sink"]  # (heads,): value norms below it are sinks
        view.inv_freq = self.inv_freqs[layer] if self.pre_rope else None
        # decoding as one matmul per head: stored channels back in rotated order, then the (symmetric) Hadamard,
        # x_stored[:, inverse] @ H == x_stored @ H[order]; on CPU one (D, D) matmul beats log2(D) butterfly passes
        h = hadamard(view.order.shape[-1])
        view.key_decoder, view.value_decoder = h[view.order], h
        return view

    def _copy(self) -> RotateKV:
        return RotateKV(self.bits, self.group, self.residual, self.clip_option, self.pre_rope, self.sinks,
                        self.sequences, self.length)

    # -- encode / decode ------------------------------------------------------------------------------
    def _bound(self) -> None:
        if self.layer is None:
            raise KVMemError(f"{self.spec}: encode with the view of one layer (`prepare(lm).for_layer(i)`)")

    def rotated_keys(self, keys: Tensor, positions: Tensor, head: int) -> Tensor:
        """Keys (n, D) after RoPE -> the reordered Hadamard-rotated keys that are quantized (float32)."""
        k = unrotate(keys.float(), positions, self.inv_freq.to(keys.device)) if self.pre_rope else keys.float()
        return fwht(k)[:, self.order[head].to(keys.device)]

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[WithSinks, WithSinks]:
        self._bound()
        sink = torch.zeros(keys.shape[0], dtype=torch.bool, device=keys.device)
        if self.sinks:
            sink = (positions == 0) | (values.float().norm(dim=-1) < float(self.threshold[head]))
        index = sink.nonzero().flatten().to(torch.int32)
        qk = self._quantize(self.rotated_keys(keys, positions, head), keys.dtype)
        qv = self._quantize(fwht(values), values.dtype)
        rows = index.long()
        return WithSinks(qk, index, keys[rows].clone()), WithSinks(qv, index.clone(), values[rows].clone())

    def decode(self, keys: WithSinks, values: WithSinks, positions: Tensor, head: int) -> tuple[Tensor, Tensor]:
        self._bound()
        k = fwht(dequantize(keys.codes).float()[:, self.inverse[head].to(positions.device)])
        if self.pre_rope:
            k = rotate(k, positions, self.inv_freq.to(k.device))
        k, v = k.to(keys.codes.dtype), fwht(dequantize(values.codes)).to(values.codes.dtype)
        k[keys.index.long()] = keys.exact
        v[values.index.long()] = values.exact
        return k, v

    def decode_heads(self, keys: list[WithSinks | None], values: list[WithSinks | None], positions: list[Tensor],
                     out_keys: Tensor, out_values: Tensor) -> None:
        """All heads in one pass: one dequantize, one batched matmul (un-order + inverse Hadamard) and one RoPE."""
        self._bound()
        if not (n := encoded_rows(keys)):  # heads of different lengths: one by one
            return super().decode_heads(keys, values, positions, out_keys, out_values)
        for parts, decoder, out in ((keys, self.key_decoder, out_keys), (values, self.value_decoder, out_values)):
            x = torch.matmul(dequantize(stack([p.codes for p in parts])).float(), decoder.to(out.device))
            if parts is keys and self.pre_rope:
                x = rotate(x, torch.stack([p[:n] for p in positions]), self.inv_freq.to(x.device))
            out[:, :n] = x
            for h, p in enumerate(parts):
                out[h, p.index.long()] = p.exact

    def _quantize(self, x: Tensor, dtype: torch.dtype) -> Quantized:
        """Per-token groups of `group` channels; each group's range scaled by `clip` (values beyond it clamp)."""
        if self.clip < 1:
            g = x.reshape(x.shape[0], -1, self.group)
            lo, hi = g.amin(-1, keepdim=True) * self.clip, g.amax(-1, keepdim=True) * self.clip
            x = torch.minimum(torch.maximum(g, lo), hi).reshape(x.shape)
        return quantize(x.to(dtype), self.bits, self.group, dim=1)

    @property
    def spec(self) -> str:
        options = {"group": self.group, "residual": self.residual, "pre_rope": self.pre_rope, "sinks": self.sinks,
                   "sequences": self.sequences, "length": self.length, "clip": self.clip_option}
        defaults = {"group": 32, "residual": 0, "pre_rope": True, "sinks": True, "sequences": 2, "length": 512,
                    "clip": None}
        return format_spec(self.name, {k: v for k, v in options.items() if v != defaults[k]})


# -- fitting --------------------------------------------------------------------------------------------
def load_or_fit_rotatekv(lm, params: dict) -> dict[str, Tensor]:
    from kvmem.calibration import load_or_fit

    return load_or_fit(lm, "rotatekv-order", params, lambda: fit_rotatekv(lm, **params))


@torch.no_grad()
def fit_rotatekv(lm, sequences: int, length: int, top: int) -> dict[str, Tensor]:
    """Per layer: the channel order of the Hadamard-rotated keys before RoPE (`order`) and after it
    (`order_post`, for the post-RoPE ablation), each head's channels sorted by their calibration mean; and each
    head's sink threshold on value norms (`sink`)."""
    from kvmem.calibration import calibration_ids
    from kvmem.quant.calibrate import calibration_kv

    acts = calibration_kv(lm, sequences, length)  # keys after RoPE
    massive = massive_activation_tokens(lm, calibration_ids(lm.tokenizer, sequences, length), top)
    out = {}
    for i, a in enumerate(acts):
        pre = unrotate(a.keys, a.positions, rope_frequencies(lm.model, i).to(a.keys.device))
        out[f"layer.{i}.order"] = fwht(pre).mean(1).argsort(-1).float()
        out[f"layer.{i}.order_post"] = fwht(a.keys).mean(1).argsort(-1).float()
        later = a.positions > 0  # the first token is a sink anyway
        norms = a.values.norm(dim=-1)[:, later].cpu()
        out[f"layer.{i}.sink"] = torch.tensor([sink_threshold(n, massive[i][later.cpu()]) for n in norms])
    return out


def massive_activation_tokens(lm, sequences: list[list[int]], top: int) -> list[Tensor]:
    """Per layer, whether each token (of all sequences joined) holds one of the `top` largest |activations| of
    its sequence in the residual stream entering that layer: the paper's attention-sink criterion."""
    per_layer: dict[int, list[Tensor]] = {}
    for ids in sequences:
        hidden = lm.model(input_ids=torch.tensor([ids], device=lm.model.device), output_hidden_states=True,
                          use_cache=False).hidden_states
        for i, h in enumerate(hidden[:-1]):  # hidden[i] enters layer i
            h = h[0].abs()
            flags = torch.zeros(h.shape[0], dtype=torch.bool)
            flags[(h.flatten().topk(min(top, h.numel())).indices // h.shape[-1]).cpu()] = True
            per_layer.setdefault(i, []).append(flags)
    return [torch.cat(per_layer[i]) for i in sorted(per_layer)]


def sink_threshold(norms: Tensor, sinks: Tensor) -> float:
    """The value-norm threshold (norm < threshold -> sink) that best separates the rows flagged `sinks` from the
    others (most sinks below it minus most others below it); 0 (no sinks) when no threshold does better than none."""
    order = norms.argsort()
    sorted_norms, gain = norms[order], (sinks[order].float() * 2 - 1).cumsum(0)
    if not len(gain) or gain.max() <= 0:
        return 0.0
    k = int(gain.argmax())
    return float((sorted_norms[k] + sorted_norms[k + 1]) / 2) if k + 1 < len(norms) else float(sorted_norms[k]) * 1.001

"""`kvquant-{4,3,2}`: KVQuant, non-uniform dense-and-sparse quantization with pre-RoPE keys.

Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference with KV Cache Quantization"
(arXiv 2401.18079). What the paper does and this file follows:

* per-channel keys, per-token values;
* keys quantized *before* RoPE: un-rotated at their positions, and the rotation re-applied on decoding
  (`pre_rope=0` switches it off, for the ablation);
* per-layer non-uniform datatypes: 2^bits levels in [-1, 1] per layer, for keys and for values, fitted
  offline by sensitivity-weighted k-means on normalized calibration activations (weights: the diagonal
  Fisher information, squared gradients of the LM loss, times the squared range that maps a normalized
  error back to the activation);
* per-vector dense-and-sparse: a fraction `outliers` of the elements is held sparse (index + fp16 value)
  and the range of the rest is quantized. Key channels get their thresholds offline (the outer quantiles
  of each channel on calibration text), so each key is encoded on arrival without waiting for a block;
  values get theirs per token online (the largest magnitudes);
* attention sinks: the first `sinks` tokens are held exactly.

Not done: Q-Norm (re-normalizing the centroids, which the paper adds for 2-bit).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme, encoded_rows
from kvmem.quant.pack import pack, unpack
from kvmem.rope import rope_frequencies, rotate, unrotate
from kvmem.spec import format_spec


@dataclass
class SparseCoded:
    """n rows of D channels: packed level indices, per-row ranges (values only), sparse outliers and rows
    held exactly. Implements kvmem.quant.base.Encoded."""

    codes: Tensor  # uint8 (n, D * bits / 8)
    low: Tensor | None  # float16 (n,): each row's range start (values); None: per-channel ranges (keys)
    span: Tensor | None  # float16 (n,)
    out_rows: Tensor  # int32 (m,) outliers: row, channel, value
    out_cols: Tensor  # uint8 (m,)
    out_vals: Tensor  # float16 (m,)
    exact_rows: Tensor  # int32 (s,) rows held exactly (attention sinks)
    exact: Tensor  # (s, D) in the cache's dtype
    bits: int
    n: int
    dim: int

    @property
    def rows(self) -> int:
        return self.n

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.codes, self.low, self.span, self.out_rows, self.out_cols, self.out_vals,
                            self.exact_rows, self.exact) if t is not None]

    def cat(self, later: SparseCoded) -> SparseCoded:
        def join(a: Tensor | None, b: Tensor | None, shift: int = 0) -> Tensor | None:
            # rows are encoded one at a time on arrival, most with no outlier or sink: nothing to copy then
            # (encoded tensors are never changed in place, so the two objects may share them)
            if a is None or not b.numel():
                return a
            return torch.cat([a, b + shift if shift else b])

        return SparseCoded(torch.cat([self.codes, later.codes]), join(self.low, later.low), join(self.span, later.span),
                           join(self.out_rows, later.out_rows, self.n), join(self.out_cols, later.out_cols),
                           join(self.out_vals, later.out_vals), join(self.exact_rows, later.exact_rows, self.n),
                           join(self.exact, later.exact), self.bits, self.n + later.n, self.dim)

    def drop(self, k: int) -> SparseCoded:
        out, ex = self.out_rows >= k, self.exact_rows >= k
        cut = lambda t: None if t is None else t[k:].clone()  # noqa: E731
        return SparseCoded(self.codes[k:].clone(), cut(self.low), cut(self.span), self.out_rows[out] - k,
                           self.out_cols[out], self.out_vals[out], self.exact_rows[ex] - k, self.exact[ex], self.bits,
                           self.n - k, self.dim)


class KVQuant(Scheme):
    calibrated = True
    encoded_types = (SparseCoded,)

    def __init__(self, bits: int, outliers: float = 0.01, sinks: int = 1, pre_rope: int = 1, sequences: int = 4,
                 length: int = 512):
        if bits not in (4, 3, 2) or not 0 <= outliers < 0.5 or sinks < 0 or pre_rope not in (0, 1):
            raise KVMemError(f"kvquant takes 4, 3 or 2 bits, an outlier fraction in [0, 0.5), sinks >= 0 and "
                             f"pre_rope 0 or 1; got {bits}, {outliers}, {sinks}, {pre_rope}")
        self.bits, self.outliers, self.sinks, self.pre_rope = bits, outliers, sinks, pre_rope
        self.sequences, self.length = sequences, length
        self.name = f"kvquant-{bits}"
        self.group, self.residual = 1, 0  # every row is encoded on arrival
        self.fitted: dict[str, Tensor] | None = None
        self.inv_freq: list[Tensor] = []
        self.layer = 0

    @property
    def spec(self) -> str:
        defaults = {"outliers": 0.01, "sinks": 1, "pre_rope": 1, "sequences": 4, "length": 512}
        return format_spec(self.name, {k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v})

    # -- fitting ---------------------------------------------------------------------------------------
    def prepare(self, lm) -> KVQuant:
        from kvmem.calibration import load_or_fit  # imported here: kvmem.compress imports the cache

        params = {"bits": self.bits, "outliers": self.outliers, "pre_rope": self.pre_rope,
                  "sequences": self.sequences, "length": self.length}
        ready = copy.copy(self)
        ready.fitted = load_or_fit(lm, self.name, params, lambda: self._fit(lm))  # one artefact per bit width
        ready.inv_freq = [rope_frequencies(lm.model, i) for i in range(lm.model.config.get_text_config().num_hidden_layers)]
        return ready

    @property
    def ready(self) -> bool:
        return self.fitted is not None

    def _fit(self, lm) -> dict[str, Tensor]:
        from kvmem.quant.calibrate import calibration_kv, weighted_kmeans_1d

        fitted = {}
        levels = 1 << self.bits
        for i, a in enumerate(calibration_kv(lm, self.sequences, self.length, fisher=True, pre_rope=bool(self.pre_rope))):
            k = a.keys.transpose(0, 1)  # (N, heads, D): per (head, channel) thresholds over tokens
            lo = torch.quantile(k, self.outliers / 2, dim=0) if self.outliers else k.amin(0)
            hi = torch.quantile(k, 1 - self.outliers / 2, dim=0) if self.outliers else k.amax(0)
            inlier = (k >= lo) & (k <= hi)
            half = ((hi - lo) / 2).clamp_min(1e-6)
            normalized = (k - lo) / half - 1
            weight = a.key_fisher.transpose(0, 1) * half.square()
            fitted[f"{i}.key_low"], fitted[f"{i}.key_high"] = lo, hi
            fitted[f"{i}.key_levels"] = weighted_kmeans_1d(normalized[inlier], weight[inlier], levels)
            v = a.values.reshape(-1, a.values.shape[-1])
            vn, low, span, keep = self._normalize_values(v)
            w = a.value_fisher.reshape(v.shape) * (span.float()[:, None] / 2).square()
            fitted[f"{i}.value_levels"] = weighted_kmeans_1d(vn[keep], w[keep], levels)
        return fitted

    def _value_outliers(self, dim: int) -> int:
        return max(1, round(self.outliers * dim)) if self.outliers else 0

    def _normalize_values(self, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per row: drop the largest magnitudes, take the range of the rest (stored in float16), and map the
        rest to [-1, 1]. Returns normalized rows, ranges' start and span (float16), and the inlier mask."""
        keep = torch.ones_like(v, dtype=torch.bool)
        n_out = self._value_outliers(v.shape[-1])
        if n_out:
            keep.scatter_(1, v.abs().topk(n_out, dim=1).indices, False)
        low = torch.where(keep, v, torch.inf).amin(1).to(torch.float16)
        span = (torch.where(keep, v, -torch.inf).amax(1) - low.float()).to(torch.float16)
        normalized = (v - low.float()[:, None]) / (span.float()[:, None] / 2).clamp_min(1e-6) - 1
        return normalized.clamp(-1, 1), low, span, keep

    # -- per layer ---------------------------------------------------------------------------------------
    def for_layer(self, layer: int) -> KVQuant:
        view = copy.copy(self)
        view.layer = layer
        return view

    def _t(self, name: str) -> Tensor:
        return self.fitted[f"{self.layer}.{name}"]

    def check(self, head_dim: int) -> None:
        if head_dim * self.bits % 8:
            raise KVMemError(f"{self.spec}: head_dim {head_dim} does not pack into whole bytes at {self.bits} bits")

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[SparseCoded, SparseCoded]:
        sinks = torch.nonzero(positions < self.sinks).flatten().to(torch.int32)
        k = unrotate(keys, positions, self.inv_freq[self.layer]) if self.pre_rope else keys
        lo, hi = self._t("key_low")[head].to(keys), self._t("key_high")[head].to(keys)
        inlier = (k >= lo) & (k <= hi)
        k_norm = ((k - lo) / ((hi - lo) / 2).clamp_min(1e-6) - 1).clamp(-1, 1)
        enc_k = self._coded(k, k_norm, inlier, self._t("key_levels"), None, None, sinks, keys)
        v_norm, low, span, keep = self._normalize_values(values.float())
        enc_v = self._coded(values, v_norm, keep, self._t("value_levels"), low, span, sinks.clone(), values)  # its own index: exports stay exact
        return enc_k, enc_v

    def encode_heads(self, keys: Tensor, values: Tensor, positions: Tensor) -> list[tuple[SparseCoded, SparseCoded]]:
        """`encode` for all heads (H, n, D) at once: one normalization, bucketize and pack per K and V; the
        outliers and sinks found once and split per head."""
        heads, n, dim = keys.shape
        sink = positions < self.sinks  # (H, n)
        k = unrotate(keys, positions, self.inv_freq[self.layer]) if self.pre_rope else keys
        lo, hi = self._t("key_low")[:, None].to(keys), self._t("key_high")[:, None].to(keys)  # (H, 1, D)
        k_norm = ((k - lo) / ((hi - lo) / 2).clamp_min(1e-6) - 1).clamp(-1, 1)
        v_norm, low, span, keep = self._normalize_values(values.float().reshape(-1, dim))
        coded = []
        for x, normalized, outlier, levels, original in (
                (k, k_norm, (k < lo) | (k > hi), self._t("key_levels"), keys),
                (values, v_norm.view(heads, n, dim), ~keep.view(heads, n, dim), self._t("value_levels"), values)):
            packed = pack(torch.bucketize(normalized.float(), ((levels[1:] + levels[:-1]) / 2).to(x.device)), self.bits)
            h, rows, cols = (outlier & ~sink[..., None]).nonzero(as_tuple=True)
            per_head = torch.bincount(h, minlength=heads).tolist()
            split = lambda t: t.split(per_head)  # noqa: E731
            sh, sinks = sink.nonzero(as_tuple=True)
            per_sink = torch.bincount(sh, minlength=heads).tolist()
            coded.append(list(zip(packed, split(rows.to(torch.int32)), split(cols.to(torch.uint8)),
                                  split(x[h, rows, cols].to(torch.float16)), sinks.to(torch.int32).split(per_sink),
                                  original[sh, sinks].split(per_sink))))
        low, span = low.view(heads, n), span.view(heads, n)
        return [(SparseCoded(ck[0], None, None, *ck[1:], self.bits, n, dim),
                 SparseCoded(cv[0], low[i], span[i], *cv[1:], self.bits, n, dim)) for i, (ck, cv) in
                enumerate(zip(*coded))]

    def _coded(self, x, normalized, inlier, levels, low, span, sinks, original) -> SparseCoded:
        codes = torch.bucketize(normalized.float(), ((levels[1:] + levels[:-1]) / 2).to(normalized.device))
        not_sink = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        not_sink[sinks.long()] = False
        rows, cols = torch.nonzero(~inlier & not_sink[:, None], as_tuple=True)
        return SparseCoded(pack(codes, self.bits), low, span, rows.to(torch.int32), cols.to(torch.uint8),
                           x[rows, cols].to(torch.float16), sinks, original[sinks.long()].clone(), self.bits, x.shape[0],
                           x.shape[1])

    def decode(self, keys: SparseCoded, values: SparseCoded, positions: Tensor, head: int) -> tuple[Tensor, Tensor]:
        lo, hi = self._t("key_low")[head], self._t("key_high")[head]
        k = self._levels(keys.codes, keys.dim, self._t("key_levels")) * ((hi - lo) / 2) + (hi + lo) / 2
        k = self._sparse(k, keys).to(keys.exact.dtype)
        if self.pre_rope:
            k = rotate(k, positions, self.inv_freq[self.layer])
        k[keys.exact_rows.long()] = keys.exact
        v = (self._levels(values.codes, values.dim, self._t("value_levels")) + 1) * (values.span.float()[:, None] / 2) + values.low.float()[:, None]
        v = self._sparse(v, values).to(values.exact.dtype)
        v[values.exact_rows.long()] = values.exact
        return k, v

    def decode_heads(self, keys: list[SparseCoded | None], values: list[SparseCoded | None], positions: list[Tensor],
                     out_keys: Tensor, out_values: Tensor) -> None:
        """All heads in one pass (the same arithmetic as `decode`): one unpack and lookup, one scatter of the
        outliers, one RoPE; only the exact sink rows go head by head."""
        if not (n := encoded_rows(keys)):  # heads of different lengths: one by one
            return super().decode_heads(keys, values, positions, out_keys, out_values)
        lo, hi = self._t("key_low")[:, None], self._t("key_high")[:, None]  # (H, 1, D)
        k = self._levels(torch.stack([c.codes for c in keys]), keys[0].dim, self._t("key_levels"))
        k = self._sparse(k.mul_((hi - lo) / 2).add_((hi + lo) / 2), keys)
        if self.pre_rope:
            k = rotate(k, torch.stack([p[:n] for p in positions]), self.inv_freq[self.layer])
        out_keys[:, :n] = k
        low, span = (torch.stack([getattr(c, f) for c in values]).float()[..., None] for f in ("low", "span"))
        v = self._levels(torch.stack([c.codes for c in values]), values[0].dim, self._t("value_levels"))
        out_values[:, :n] = self._sparse(v.add_(1).mul_(span / 2).add_(low), values)
        for h, (ck, cv) in enumerate(zip(keys, values)):
            out_keys[h, ck.exact_rows.long()] = ck.exact
            out_values[h, cv.exact_rows.long()] = cv.exact

    def _levels(self, packed: Tensor, dim: int, levels: Tensor) -> Tensor:
        """The levels that packed codes (..., n, D * bits / 8) stand for, (..., n, D)."""
        codes = unpack(packed, self.bits, dim)
        return levels.index_select(0, codes.reshape(-1).int()).view(codes.shape)  # a flat gather: faster than levels[codes]

    @staticmethod
    def _sparse(x: Tensor, coded: SparseCoded | list[SparseCoded]) -> Tensor:
        """x (n, D) with the outliers written back (in place); x (H, n, D) for a list of heads."""
        if not isinstance(coded, list):
            x[coded.out_rows.long(), coded.out_cols.long()] = coded.out_vals.float()
            return x
        n, d = x.shape[-2:]
        flat = torch.cat([(c.out_rows.long() + h * n) * d + c.out_cols.long() for h, c in enumerate(coded)])
        x.view(-1).index_put_((flat,), torch.cat([c.out_vals for c in coded]).to(x.dtype))
        return x

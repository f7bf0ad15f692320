"""`cachegen`: a chunk's KV as CacheGen's arithmetic-coded bitstream.

Liu et al., SIGCOMM 2024, "CacheGen: KV Cache Compression and Streaming for Fast Large Language Model
Serving" (arXiv 2310.07240). The encoder, per layer, keys and values separately:

1. Change-based encoding with anchor tokens: tokens are split into groups of `group` consecutive tokens
   (paper: 10). A group's first token (the anchor) is encoded on its own, every other token as its delta to
   the anchor (not to the previous token, so groups decode independently). The delta is taken against the
   *reconstructed* anchor (closed loop), so no element carries its anchor's quantization error.
   `delta=none` (not the paper's; issue 36) codes every token as itself at its layer's bins, no anchors: with
   anchors as coarse as the deltas the reconstruction is the same either way, and on smollm2-135m's KV the
   deltas' symbols carry more entropy than the tokens' own (results/reuse/report.md, "Codec frontier").
   With it, `sink=N` codes the context's first N positions at `anchor_bin` (pooled like anchors): the anchors'
   fine bin had been protecting the attention sink (position 0), and values at coarse bins without it cost
   smollm2-135m +16 % Δppl where 10 % fine anchors cost +2 % (StreamingLLM's sink; not in CacheGen).
2. Layer-wise quantization: each channel is normalized by its mean and std in the chunk (per layer, head,
   channel: float16 side info, float32 if out of float16's range). Anchors use the fine bin `anchor_bin`
   (in stds); deltas a bin that grows with depth: `key_bins`/`value_bins` give it for the first third,
   middle third and last third of the layers (errors in early layers propagate through the later ones).
3. Arithmetic coding: symbols are range-coded (`constriction`) with one distribution per (layer, K/V, head,
   channel) for deltas and one per (layer, K/V) for the few anchors; the distributions are the chunk's
   symbol histograms, stored beside the stream as 3-bit log-counts of |symbol| (deltas are zero-mean). The delta alphabet covers +-`clip` stds
   (anchors: +-127 bins); a symbol beyond it is coded as an escape and its value stored exactly aside.

Stream layout, layer l: `l.stream` uint8 (little-endian range-coder words: K anchors of all heads, V anchors,
then per head its K deltas channel by channel, then V's), `l.escapes` int16 (int32 if needed; stream order),
`l.k_scale` / `l.v_scale` (H, 2, D) mean and std, `l.anchor_hist` / `l.k_hist` / `l.v_hist` packed 3-bit
histograms (2 x 129, H x D x (half + 2)). The meta holds per layer the head lengths, bins, alphabet half
widths, dims and dtype; a head's positions are its first position there when consecutive, else
`l.h.positions` int32. `decode` needs only the tensors and the meta.
"""

from __future__ import annotations

import math

import constriction
import numpy as np
import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.pack import pack, unpack
from kvmem.rows import ExportedRows
from kvmem.spec import check_options, format_spec, parse_spec
from kvmem.store.codec import Codec, _dtype, _tensor

ANCHOR_HALF = 127  # anchor alphabet -127..127 plus the escape: 256 symbols
# Defaults measured on smollm2-135m while writing this (1024-token prefills, 256-token continuations): next-token KL and Δppl about kivi-4's at
# 0.47-0.49x kivi-8's bytes (1024- and 256-token chunks); ~1/3 of kivi-8 takes bins near 0.8 (KL ~9x kivi-4's).
# Issue 36's frontier (results/reuse/report.md, "Codec frontier"; 12 documents): the default is 0.48x at +0.50 %
# [+0.06, +0.92] on smollm2-135m and 0.50x at +2.3 % on gemma3-270m; no setting of the grid reaches 1/3 of kivi-8
# at Δppl <= 1 % (best at ~1/3: delta=none:sink=4 with earlier layers finer, 0.327x at +1.4 % on smollm2), so the
# defaults stay the paper's anchor deltas.
DEFAULTS = {"group": 10, "anchor_bin": 0.05, "key_bins": (0.25, 0.3, 0.35), "value_bins": (0.2, 0.45, 0.6), "clip": 4.0,
            "delta": "anchor", "sink": 0}


def _bins(value, option: str) -> tuple[float, float, float]:
    """`key_bins=0.5` (every layer) or `key_bins=0.3+0.5+0.7` (first, middle, last third of the layers)."""
    parts = value if isinstance(value, (list, tuple)) else str(value).split("+")
    try:
        bins = tuple(float(b) for b in parts)
    except ValueError:
        bins = ()
    bins = bins * 3 if len(bins) == 1 else bins
    if len(bins) != 3 or not all(b > 0 for b in bins):
        raise KVMemError(f"cachegen option {option} takes one positive bin size or three (a+b+c), got {value!r}")
    return bins


def _quantize(x: Tensor, group: int, anchor_bin: float, bin: float, fine: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x (T, D) -> (scale (2, D): mean and std as stored, anchor symbols (ceil(T / group), D), delta symbols
    (T - anchors, D), int64). Rounding is to the nearest bin, so |error| <= bin / 2 stds. group 0 (delta=none):
    no deltas; the rows marked `fine` (T,) bool (sink tokens) are the "anchors", at anchor_bin, every other
    row is its own "delta" symbol at bin."""
    x = x.float()
    mean = x.mean(0) if len(x) else x.new_zeros(x.shape[1])
    std = x.std(0, correction=0) if len(x) else x.new_zeros(x.shape[1])
    std = torch.maximum(std, mean.abs() * 2**-10).clamp_min(2**-14)  # a constant channel gets a usable step
    scale = torch.stack([mean, std])
    scale = scale.half() if scale.half().isfinite().all() else scale
    z = (x - scale[0].float()) / scale[1].float()
    if not group:  # delta=none: every token is coded as itself, the sink tokens at the fine bin
        fine = torch.zeros(len(x), dtype=torch.bool) if fine is None else fine
        return (scale, (z[fine] / anchor_bin).round().clamp(-2**30, 2**30).long(),
                (z[~fine] / bin).round().clamp(-2**30, 2**30).long())
    qa = (z[::group] / anchor_bin).round().clamp(-2**30, 2**30)
    t = torch.arange(len(x))
    anchor = (qa * anchor_bin)[t // group]  # each token's anchor as the decoder sees it (closed loop)
    qd = ((z - anchor)[t % group != 0] / bin).round().clamp(-2**30, 2**30)
    return scale, qa.long(), qd.long()


def _dequantize(scale: Tensor, qa: Tensor, qd: Tensor, group: int, anchor_bin: float, bin: float, dtype,
                fine: Tensor | None = None) -> Tensor:
    if not group:
        fine = torch.zeros(qa.shape[0] + qd.shape[0], dtype=torch.bool) if fine is None else fine
        z = torch.empty(len(fine), qd.shape[1])
        z[fine], z[~fine] = qa.float() * anchor_bin, qd.float() * bin
        return (z * scale[1].float() + scale[0].float()).to(dtype)
    t = torch.arange(qa.shape[0] + qd.shape[0])
    z = (qa.float() * anchor_bin)[t // group]
    z[t % group != 0] += qd.float() * bin
    return (z * scale[1].float() + scale[0].float()).to(dtype)


def _indices(q: Tensor, half: int) -> Tensor:
    """Alphabet indices of symbols q: -half..half at 0..2 half, anything beyond is the escape 2 half + 1."""
    return torch.where(q.abs() > half, 2 * half + 1, q + half)


def _hist(idx: Tensor, half: int) -> Tensor:
    """Histograms of alphabet indices (..., N) as (..., half + 2) 3-bit codes, one per |symbol| 0..half and the
    escape: 0 for unseen, else 7 + log2(count / top count), at least 1. Deltas are zero-mean: folding the sign
    and octave steps cost the coder ~0.05-0.08 bit a symbol against 4-bit full histograms, and save 60% of their
    bytes (~0.35 bit a symbol at the store's 256-token chunks, where a channel has only ~230 deltas)."""
    counts = torch.zeros((*idx.shape[:-1], 2 * half + 2)).scatter_add_(-1, idx, torch.ones(idx.shape))
    folded = torch.cat([counts[..., half:half + 1], (counts[..., half + 1:-1] + counts[..., :half].flip(-1)) / 2,
                        counts[..., -1:]], -1)
    top = folded.amax(-1, keepdim=True).clamp_min(1)
    return torch.where(folded > 0, (7 + torch.log2(folded / top)).round().clamp(1, 7), 0).to(torch.uint8)


def _probs(hist: Tensor) -> np.ndarray:
    """The coder's probabilities (..., 2 half + 2) for `_hist` codes (..., half + 2), unfolded: symbol s has
    |s|'s. Encoder and decoder compute them from the same stored codes."""
    code = hist.numpy().astype(np.float32)
    p = np.where(code > 0, np.exp2(code - 7), 0)
    half = code.shape[-1] - 2
    return np.ascontiguousarray(np.concatenate([p[..., half:0:-1], p[..., :half + 1], p[..., -1:]], -1), dtype=np.float32)


def _model(probs: np.ndarray):
    return constriction.stream.model.Categorical(probs, perfect=False)


class CacheGenCodec(Codec):
    name = "cachegen"
    version = 1

    def __init__(self, group: int = 10, anchor_bin: float = 0.05, key_bins: str = "0.25+0.3+0.35",
                 value_bins: str = "0.2+0.45+0.6", clip: float = 4.0, delta: str = "anchor", sink: int = 0):
        if group < 1 or anchor_bin <= 0 or clip <= 0:
            raise KVMemError(f"cachegen takes group >= 1, anchor_bin > 0 and clip > 0; got group {group}, "
                             f"anchor_bin {anchor_bin}, clip {clip}")
        if delta not in ("anchor", "none"):
            raise KVMemError(f"cachegen option delta is anchor (to the group's anchor token) or none (every token "
                             f"coded as itself), got {delta!r}")
        if delta == "none" and group != DEFAULTS["group"]:
            raise KVMemError("cachegen option delta=none has no anchor groups: group does not apply")
        if sink < 0 or (sink and delta != "none"):
            raise KVMemError(f"cachegen option sink (the first positions coded at anchor_bin) is >= 0 and only for "
                             f"delta=none (with anchor deltas every group's anchor is already fine); got sink {sink}")
        if delta == "none" and anchor_bin != DEFAULTS["anchor_bin"] and not sink:
            raise KVMemError("cachegen option delta=none has no anchors: anchor_bin applies only with sink > 0")
        self.group, self.anchor_bin, self.clip, self.delta, self.sink = group, float(anchor_bin), float(clip), delta, sink
        self.key_bins, self.value_bins = _bins(key_bins, "key_bins"), _bins(value_bins, "value_bins")

    @property
    def spec(self) -> str:
        fmt = lambda v: "+".join(f"{b:g}" for b in v) if isinstance(v, tuple) else v  # noqa: E731
        return format_spec(self.name, {k: fmt(getattr(self, k)) for k, d in DEFAULTS.items() if getattr(self, k) != d})

    @property
    def coded_group(self) -> int:
        """The group size as stored in the meta: 0 for delta=none (no anchors)."""
        return self.group if self.delta == "anchor" else 0

    def layer_bins(self, layer: int, n_layers: int) -> tuple[float, float]:
        """(key bin, value bin) of a layer: its third of the depth picks the entry of key_bins / value_bins."""
        third = min(3 * layer // max(n_layers, 1), 2)
        return self.key_bins[third], self.value_bins[third]

    def quantize(self, layers: list[ExportedRows]) -> list[list[list[tuple]]]:
        """Per layer, per field (keys, values), per head: `_quantize`'s (scale, anchor symbols, delta symbols)."""
        for rows in layers:
            if any("log_weights" in h for h in rows.heads):
                raise KVMemError("the cachegen codec cannot store rows that stand for several tokens (log-weights); use raw")
        return [[[_quantize(h[f], self.coded_group, self.anchor_bin, b, _fine(h["positions"], self.coded_group, self.sink))
                  for h in rows.heads]
                 for f, b in zip(("keys", "values"), self.layer_bins(l, len(layers)))] for l, rows in enumerate(layers)]

    def reconstruct(self, layers: list[ExportedRows]) -> list[ExportedRows]:
        """What `decode(encode(layers))` returns, without the entropy coding: the quantizer's reconstruction."""
        positions = {f"{l}.{h}.positions": head["positions"] for l, r in enumerate(layers) for h, head in enumerate(r.heads)}
        metas = [self._layer_meta(l, r, len(layers)) for l, r in enumerate(layers)]
        return _rows(self.quantize(layers), metas, positions, self.coded_group, self.anchor_bin, self.sink)

    def _layer_meta(self, l: int, rows: ExportedRows, n_layers: int) -> dict:
        starts = []
        for head in rows.heads:
            p = head["positions"]
            first = int(p[0]) if p.numel() else 0
            consecutive = p.dtype == torch.int32 and torch.equal(p, torch.arange(first, first + p.numel(), dtype=torch.int32))
            starts.append(first if consecutive else None)
        bins = self.layer_bins(l, n_layers)
        return {"lengths": rows.lengths(), "starts": starts, "bins": list(bins),
                "halves": [min(max(math.ceil(self.clip / b - 1e-9), 1), 127) for b in bins],  # delta alphabets
                "dims": [rows.heads[0][f].shape[1] if rows.heads else 0 for f in ("keys", "values")],
                "dtype": str(rows.heads[0]["keys"].dtype).removeprefix("torch.") if rows.heads else "float32"}

    def encode(self, layers: list[ExportedRows]) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        metas = [self._layer_meta(l, rows, len(layers)) for l, rows in enumerate(layers)]
        for l, (rows, fields, lm) in enumerate(zip(layers, self.quantize(layers), metas)):
            for h, start in enumerate(lm["starts"]):
                if start is None:
                    tensors[f"{l}.{h}.positions"] = rows.heads[h]["positions"].contiguous()
            for kv, heads, d in zip("kv", fields, lm["dims"]):
                tensors[f"{l}.{kv}_scale"] = torch.stack([s for s, _, _ in heads]) if heads else torch.zeros(0, 2, d)
            # Blocks in stream order, one distribution per row: K anchors of all heads pooled (a head holds only
            # T / group anchors a channel), V anchors, then per head its deltas (D, N), channel by channel.
            blocks = [(torch.cat([qa.flatten() for _, qa, _ in heads] + [torch.zeros(0, dtype=torch.long)])[None], ANCHOR_HALF)
                      for heads in fields]
            blocks += [(qd.t(), half) for heads, half in zip(fields, lm["halves"]) for _, _, qd in heads]
            encoder, hists, escapes = constriction.stream.queue.RangeEncoder(), [], [torch.zeros(0, dtype=torch.long)]
            for q, half in blocks:
                idx = _indices(q, half)
                hists.append(_hist(idx, half))
                escapes.append(q[idx == 2 * half + 1])  # row-major: the order the coder meets them
                probs, idx = _probs(hists[-1]), idx.numpy().astype(np.int32)
                for r in range(len(q) if q.shape[1] else 0):  # one call per distribution: the coder loops in Rust
                    encoder.encode(idx[r], _model(probs[r]))
            n_heads = len(rows.heads)
            for name, part in (("anchor_hist", hists[:2]), ("k_hist", hists[2:2 + n_heads]), ("v_hist", hists[2 + n_heads:])):
                tensors[f"{l}.{name}"] = pack(torch.cat([h.flatten() for h in part] + [torch.zeros(0, dtype=torch.uint8)]), 3)
            tensors[f"{l}.stream"] = torch.from_numpy(encoder.get_compressed().astype("<u4").view(np.uint8).copy())
            escapes = torch.cat(escapes)
            small = not escapes.numel() or int(escapes.abs().max()) < 2**15  # most escapes are a few bins past the clip
            tensors[f"{l}.escapes"] = escapes.to(torch.int16 if small else torch.int32)
        return tensors, {"group": self.coded_group, "anchor_bin": self.anchor_bin, "sink": self.sink, "layers": metas}

    def layer_count(self, meta: dict) -> int:
        sink = meta.get("sink", 0)
        if not isinstance(sink, int) or sink < 0 or (sink and meta["group"]):
            raise KVMemError(f"cachegen chunk: bad sink {sink!r} in its meta")
        return len(meta["layers"])

    def decode_layer(self, tensors: dict[str, Tensor], meta: dict, l: int) -> ExportedRows:
        group, anchor_bin, sink, lm = meta["group"], meta["anchor_bin"], meta.get("sink", 0), meta["layers"][l]
        lengths, dims, halves = lm["lengths"], lm["dims"], lm["halves"]
        if group:
            anchors = [-(-t // group) for t in lengths]
        else:  # the sink rows of each head (none without a sink)
            anchors = [int(_fine(_positions(lm, tensors, l, h), 0, sink).sum()) for h in range(len(lengths))]
        hists = list(unpack(_tensor(tensors, f"{l}.anchor_hist"), 3, 2 * (ANCHOR_HALF + 2)).view(2, 1, -1))
        for kv, d, half in zip("kv", dims, halves):
            hist = unpack(_tensor(tensors, f"{l}.{kv}_hist"), 3, len(lengths) * d * (half + 2))
            hists += list(hist.view(len(lengths), d, half + 2))
        plan = [(sum(anchors) * d, ANCHOR_HALF) for d in dims]  # (symbols a row, half): blocks as `encode` wrote them
        plan += [(t - a, half) for half in halves for t, a in zip(lengths, anchors)]
        words = np.frombuffer(_tensor(tensors, f"{l}.stream").numpy().tobytes(), dtype="<u4").astype(np.uint32)
        decoder = constriction.stream.queue.RangeDecoder(words)
        escapes, taken, blocks = _tensor(tensors, f"{l}.escapes"), 0, []
        for (n, half), hist in zip(plan, hists):
            probs = _probs(hist)
            idx = np.stack([decoder.decode(_model(p), n) for p in probs]) if n and len(hist) else np.zeros((len(hist), n))
            idx = torch.from_numpy(idx.astype(np.int64))
            q, hit = idx - half, idx == 2 * half + 1
            q[hit] = escapes[taken:taken + int(hit.sum())].long()
            taken += int(hit.sum())
            blocks.append(q)
        n_heads = len(lengths)
        fields = []
        for i, d in enumerate(dims):
            qas = blocks[i][0].split([a * d for a in anchors])
            qds = blocks[2 + i * n_heads:2 + (i + 1) * n_heads]
            fields.append([(_tensor(tensors, f"{l}.{'kv'[i]}_scale")[h], qas[h].view(a, d), qds[h].t())
                           for h, a in enumerate(anchors)])
        return _layer_rows(l, fields, lm, tensors, group, anchor_bin, sink)


def _fine(positions: Tensor, group: int, sink: int) -> Tensor | None:
    """delta=none (group 0): which rows are sink tokens (position < sink), coded at the fine anchor bin."""
    return None if group else positions < sink


def _positions(lm: dict, tensors: dict[str, Tensor], l: int, h: int) -> Tensor:
    """Head h's positions: consecutive from its start in the layer meta, else stored beside the stream."""
    start = lm["starts"][h]
    return (torch.arange(start, start + lm["lengths"][h], dtype=torch.int32) if start is not None
            else _tensor(tensors, f"{l}.{h}.positions").clone())


def _rows(quantized: list, metas: list[dict], tensors: dict[str, Tensor], group: int, anchor_bin: float,
          sink: int = 0) -> list[ExportedRows]:
    """Raw rows from quantized symbols, every layer (`_layer_rows`)."""
    return [_layer_rows(l, fields, lm, tensors, group, anchor_bin, sink) for l, (fields, lm) in enumerate(zip(quantized, metas))]


def _layer_rows(l: int, fields: list, lm: dict, tensors: dict[str, Tensor], group: int, anchor_bin: float,
                sink: int = 0) -> ExportedRows:
    """Layer l's raw rows from its quantized symbols: dequantized keys and values, positions from the meta or `tensors`."""
    dtype = _dtype(lm["dtype"])
    heads = []
    for h in range(len(lm["starts"])):
        positions = _positions(lm, tensors, l, h)
        fine = _fine(positions, group, sink)
        kv = [_dequantize(*fields[i][h], group, anchor_bin, lm["bins"][i], dtype, fine) for i in range(2)]
        heads.append({"keys": kv[0], "values": kv[1], "positions": positions})
    return ExportedRows(heads)


def parse_cachegen(spec: str) -> CacheGenCodec:
    """`cachegen` or `cachegen:key_bins=0.3+0.5+0.7:value_bins=0.5:anchor_bin=0.05:group=10:clip=4` (or
    `delta=none[:sink=N]` instead of the anchor groups)."""
    name, options = parse_spec(spec, ("cachegen",), "codec")
    check_options(name, CacheGenCodec, options)
    return CacheGenCodec(**options)

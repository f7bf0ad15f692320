"""`cq-2` and `cq-1`: Coupled Quantization, learned codebooks over groups of coupled channels.

Zhang, Yi, Xu, Shrivastava 2024, "KV Cache is 1 Bit Per Channel: Efficient Large Language Model Inference
with Coupled Quantization" (NeurIPS 2024, arXiv 2405.03917; abstract in shared/seeds). The channels of a
key or value embedding are strongly inter-dependent (their joint entropy grows slower than the sum of the
marginals), so CQ quantizes `c` contiguous channels jointly: each group of `c` channels of a token is
replaced by the index of the nearest of 2^b centroids, learned offline per layer and channel group (so per
KV head), separately for keys and values. That is b / c bits per channel and nothing else per token: no
scales, zero-points or outliers. The paper's settings at 8-bit codes: CQ-2c8b (4 bits per channel),
CQ-4c8b (2: `cq-2`) and CQ-8c8b (1: `cq-1`).

Centroids are learned by k-means on calibration activations (`kvmem.quant.calibrate`), each activation
weighted by its diagonal Fisher information summed over the coupled channels ("Fisher-guided centroid
learning": the squared loss gradient tells how much an error on that token matters). Codebooks are fitted
once per model and cached (`kvmem.calibration.load_or_fit`, refitted on any fingerprint or
parameter change). Keys are coupled before RoPE (`pre_rope`, as KVQuant, whose sensitivity-weighted
calibration CQ extends): pre-RoPE channels keep their joint structure at every position, while after RoPE
the low channels turn with the position and the joint distribution smears into rings. The paper's
downstream experiments keep the newest 32 tokens in full precision (`residual`), as here by default; each
older row is encoded on its own (`group = 1`).

Fitting (`fit_codebooks`): Lloyd's algorithm from weighted k-means++ seeds, batched over all (KV head,
channel group) pairs of a layer, on `samples` rows drawn with `seed` from `sequences` x `length` tokens of
the shipped text. Deviations from the paper: it calibrates on far more text (a general corpus); here the
calibration stretch is small so one fit takes a minute or two of one CPU thread (see DEFAULTS); pre-RoPE
coupling of keys is this implementation's choice (the abstract does not say). The full-precision residual
is held in the cache's dtype.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme, encoded_rows
from kvmem.quant.pack import pack, unpack
from kvmem.spec import format_spec

CODE_BITS = 8  # the paper's code width at every budget: 256 centroids per group of channels
# Fitting defaults: 2 x 1024 calibration tokens (forward and backward, for the Fisher weights), 2048 rows, 10 Lloyd
# iterations from k-means++ seeds: about 80 s (SmolLM2, cq-2) and 110 s (Gemma-3 270M) of one CPU thread per fit;
# 4x the rows and 25 iterations lower the held-out error by about 5% (three SmolLM2 layers, keys and values).
DEFAULTS = dict(residual=32, sequences=2, length=1024, samples=2048, iters=10, fisher=True, pre_rope=True, seed=0)


@dataclass
class Codes:
    """One head's coupled codes (rows, channels / c) packed at `bits` bits each: all a CQ cache holds
    (the codebook belongs to the model, not to the cache)."""

    packed: Tensor  # uint8 (rows, ceil(groups / 8) * bits)
    bits: int
    groups: int
    dtype: torch.dtype

    @property
    def rows(self) -> int:
        return self.packed.shape[0]

    def tensors(self) -> list[Tensor]:
        return [self.packed]

    def cat(self, later: Codes) -> Codes:
        return Codes(torch.cat([self.packed, later.packed]), self.bits, self.groups, self.dtype)

    def drop(self, n: int) -> Codes:
        return Codes(self.packed[n:].clone(), self.bits, self.groups, self.dtype)

    def codes(self) -> Tensor:
        return unpack(self.packed, self.bits, self.groups).long()


def nearest(x: Tensor, centroids: Tensor, chunk: int = 1 << 24) -> Tensor:
    """Index (G, N) of the nearest centroid (G, K, c) of each point x (G, N, c), per group (in slices of
    groups, so the (G, N, K) distances never take more than about `chunk` elements at once)."""
    g, n, _ = x.shape
    k = centroids.shape[1]
    step = max(1, chunk // max(1, n * k))
    out = []
    for s in range(0, g, step):
        xs, cs = x[s:s + step], centroids[s:s + step]
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 does not change the argmin
        d = torch.baddbmm(cs.square().sum(-1)[:, None, :], xs, cs.transpose(1, 2), alpha=-2)
        out.append(d.argmin(-1))
    return torch.cat(out) if len(out) > 1 else out[0]


def kmeans(x: Tensor, k: int, weights: Tensor | None = None, iters: int = 25, seed: int = 0) -> Tensor:
    """k centroids (G, k, c) per group of the points x (G, N, c) minimising sum(w * |x - c|^2) (Lloyd's
    algorithm, batched over groups; initialised by weighted k-means++ seeding with a fixed seed; stops early
    once no assignment changes). An empty cluster keeps its centroid."""
    x = x.float()
    g, n, c = x.shape
    w = torch.ones(g, n, device=x.device) if weights is None else weights.float().clamp_min(0).to(x.device)
    mean = w.mean(-1, keepdim=True)  # scale-free (Fisher ~ 1e-10); a group with no weight at all: unweighted
    w = torch.where(mean > 0, w / mean.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(w))
    centroids = plus_plus(x, k, w, torch.Generator(device=x.device).manual_seed(seed))
    assign = None
    for _ in range(iters):
        new = nearest(x, centroids)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        mass = torch.zeros(g, k, device=x.device).scatter_add_(1, assign, w)
        total = torch.zeros(g, k, c, device=x.device).scatter_add_(1, assign[..., None].expand(g, n, c), w[..., None] * x)
        centroids = torch.where(mass[..., None] > 0, total / mass[..., None].clamp_min(1e-30), centroids)
    return centroids


def plus_plus(x: Tensor, k: int, w: Tensor, gen: torch.Generator) -> Tensor:
    """k-means++ seeding, batched over groups: each next centroid is a point drawn with probability
    proportional to its weight times its squared distance to the nearest centroid so far (by weight alone
    once every point is a centroid, e.g. fewer distinct points than k)."""
    g, n, c = x.shape
    channels = x.permute(2, 0, 1).contiguous()  # (c, G, N): one channel at a time is the fast distance here
    centroids = torch.empty(g, k, c, device=x.device)

    def draw(p: Tensor) -> Tensor:  # a point per group, with probability p (G, N) (multinomial is ~20x slower)
        cdf = p.cumsum(-1)
        u = torch.rand(g, 1, generator=gen, device=x.device) * cdf[:, -1:]
        return x[torch.arange(g, device=x.device), torch.searchsorted(cdf, u, side="right")[:, 0].clamp_max(n - 1)]

    d = torch.full((g, n), torch.inf, device=x.device)
    p = w
    for j in range(k):
        centroids[:, j] = draw(p)
        new = torch.zeros(g, n, device=x.device)
        for ch in range(c):
            new += (channels[ch] - centroids[:, j, ch, None]).square()
        d = torch.minimum(d, new)
        p = w * d
        p = torch.where(p.sum(-1, keepdim=True) > 0, p, w)
    return centroids


class CoupledQuantization(Scheme):
    calibrated = True
    encoded_types = (Codes,)
    group = 1  # each token's row is encoded on its own

    def __init__(self, bits: int, residual: int = 32, sequences: int = DEFAULTS["sequences"],
                 length: int = DEFAULTS["length"], samples: int = DEFAULTS["samples"], iters: int = DEFAULTS["iters"],
                 fisher: bool = True, pre_rope: bool = True, seed: int = 0):
        if bits not in (1, 2) or residual < 0 or min(sequences, length, samples, iters) < 1 or seed < 0:
            raise KVMemError(f"cq takes 1 or 2 bits per channel, residual >= 0, seed >= 0 and sequences, length, "
                             f"samples, iters >= 1; got {bits} bits, residual {residual}, sequences {sequences}, "
                             f"length {length}, samples {samples}, iters {iters}, seed {seed}")
        self.bits, self.residual = bits, residual  # bits: code bits per element (8-bit codes over 8 / bits channels)
        self.channels = CODE_BITS // bits  # CQ-4c8b at 2 bits per channel, CQ-8c8b at 1
        self.name = f"cq-{bits}"
        self.fit_params = dict(sequences=sequences, length=length, samples=samples, iters=iters, fisher=fisher,
                               pre_rope=pre_rope, seed=seed, channels=self.channels, code_bits=CODE_BITS)
        self.pre_rope = pre_rope
        self.books: dict[str, Tensor] | None = None  # "layer.{i}.keys"/".values": (heads, groups, 2^b, c)
        self.inv_freq: list[Tensor] | None = None  # per layer, to undo and redo RoPE on keys
        self.layer: int | None = None  # set on a layer's view (`for_layer`)
        self.key_book: Tensor | None = None  # the layer's codebooks, on its view
        self.value_book: Tensor | None = None

    # -- calibration ----------------------------------------------------------------------------------
    def check(self, head_dim: int) -> None:
        if head_dim < 1 or head_dim % self.channels:
            raise KVMemError(f"{self.spec}: head_dim {head_dim} is not a multiple of the {self.channels} coupled "
                             f"channels (CQ-{self.channels}c{CODE_BITS}b)")

    def prepare(self, lm) -> CoupledQuantization:
        """A copy of this scheme with the codebooks fitted for `lm` (loaded from the artefact cache, or fitted
        once and saved); this instance stays unprepared."""
        from kvmem.calibration import load_or_fit  # imported here: kvmem.compress imports the cache
        from kvmem.rope import rope_frequencies

        config = lm.model.config.get_text_config()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.check(head_dim)  # before fitting anything
        books = load_or_fit(lm, self.name, self.fit_params, lambda: fit_codebooks(lm, **self.fit_params))
        layers, heads = config.num_hidden_layers, config.num_key_value_heads
        want = (heads, head_dim // self.channels, 1 << CODE_BITS, self.channels)
        for i in range(layers):
            for kind in ("keys", "values"):
                got = books.get(f"layer.{i}.{kind}")
                if got is None or tuple(got.shape) != want:
                    raise KVMemError(f"{self.spec}: the fitted codebook of layer {i} ({kind}) does not match "
                                     f"{lm.name}'s layers or heads: {None if got is None else tuple(got.shape)} "
                                     f"for {want}")
        out = copy.copy(self)
        out.fit_params = dict(self.fit_params)
        out.books = books
        out.inv_freq = [rope_frequencies(lm.model, i).cpu() for i in range(layers)] if self.pre_rope else None
        return out

    @property
    def ready(self) -> bool:
        return self.books is not None

    def for_layer(self, layer: int) -> CoupledQuantization:
        if self.books is None:
            raise KVMemError(f"{self.spec} is fitted per model: make it with kvmem.quant.get_scheme('{self.spec}', lm)")
        if f"layer.{layer}.keys" not in self.books:
            raise KVMemError(f"{self.spec}: no codebook for layer {layer} (fitted for {len(self.books) // 2} layers)")
        view = copy.copy(self)
        view.layer = layer
        view.key_book, view.value_book = self.books[f"layer.{layer}.keys"], self.books[f"layer.{layer}.values"]
        return view

    # -- encode / decode ------------------------------------------------------------------------------
    def _bound(self) -> None:
        if self.layer is None:
            raise KVMemError(f"{self.spec}: encode and decode with the view of one layer (`prepare(lm).for_layer(i)`)")

    @staticmethod
    def encode_rows(x: Tensor, book: Tensor) -> Codes:
        """Rows x (n, D) as the index of the nearest centroid of each group of coupled channels (book:
        (groups, 2^b, c), one head's codebooks)."""
        groups = book.shape[0]
        xg = x.float().reshape(x.shape[0], groups, -1).transpose(0, 1)  # (groups, n, c)
        codes = nearest(xg, book.to(xg.device, torch.float32)).transpose(0, 1)  # (n, groups)
        return Codes(pack(codes, CODE_BITS), CODE_BITS, groups, x.dtype)

    @staticmethod
    def decode_rows(q: Codes, book: Tensor) -> Tensor:
        """The rows (n, groups * c), float32, that codes `q` stand for (book: one head's (groups, 2^b, c))."""
        return CoupledQuantization.decode_packed(q.packed[None], q.groups, book[None])[0]

    @staticmethod
    def decode_packed(packed: Tensor, groups: int, books: Tensor) -> Tensor:
        """Rows (H, n, groups * c), float32, from the packed codes (H, n, B) of H heads with their codebooks
        (H, groups, 2^b, c): one flat gather for all heads."""
        codes = unpack(packed, CODE_BITS, groups).long()  # (H, n, groups)
        books = books.to(codes.device, torch.float32)
        heads, _, k, c = books.shape
        offsets = torch.arange(heads * groups, device=codes.device).view(heads, 1, groups) * k  # (h, g)'s centroids
        flat = books.reshape(-1, c).index_select(0, (codes + offsets).reshape(-1))
        return flat.view(heads, packed.shape[1], groups * c)

    def encode(self, keys: Tensor, values: Tensor, positions: Tensor, head: int) -> tuple[Codes, Codes]:
        self._bound()
        return (self.encode_rows(self._unrope(keys, positions), self.key_book[head]),
                self.encode_rows(values, self.value_book[head]))

    def decode(self, keys: Codes, values: Codes, positions: Tensor, head: int) -> tuple[Tensor, Tensor]:
        self._bound()
        k = self._rope(self.decode_rows(keys, self.key_book[head]), positions)
        return k.to(keys.dtype), self.decode_rows(values, self.value_book[head]).to(values.dtype)

    def encode_heads(self, keys: Tensor, values: Tensor, positions: Tensor) -> list[tuple[Codes, Codes]]:
        """`encode` for all heads (H, n, D) at once: one nearest-centroid search over every (head, group)."""
        self._bound()
        coded = []
        for x, books in ((self._unrope(keys, positions), self.key_book), (values, self.value_book)):
            heads, n, _ = x.shape
            groups = books.shape[1]
            xg = x.float().reshape(heads, n, groups, -1).transpose(1, 2).reshape(heads * groups, n, -1)
            codes = nearest(xg, books.flatten(0, 1).to(xg.device, torch.float32)).view(heads, groups, n).transpose(1, 2)
            coded.append([Codes(p, CODE_BITS, groups, x.dtype) for p in pack(codes, CODE_BITS)])
        return list(zip(*coded))

    def decode_heads(self, keys: list[Codes | None], values: list[Codes | None], positions: list[Tensor],
                     out_keys: Tensor, out_values: Tensor) -> None:
        """All heads in one pass: one gather per K and V, one RoPE."""
        self._bound()
        if not (n := encoded_rows(keys)):  # heads of different lengths: one by one
            return super().decode_heads(keys, values, positions, out_keys, out_values)
        k = self.decode_packed(torch.stack([q.packed for q in keys]), keys[0].groups, self.key_book)
        out_keys[:, :n] = self._rope(k, torch.stack([p[:n] for p in positions]))
        out_values[:, :n] = self.decode_packed(torch.stack([q.packed for q in values]), values[0].groups, self.value_book)

    def _unrope(self, keys: Tensor, positions: Tensor) -> Tensor:
        if not self.pre_rope:
            return keys
        from kvmem.rope import unrotate

        return unrotate(keys.float(), positions.to(keys.device), self.inv_freq[self.layer].to(keys.device))

    def _rope(self, keys: Tensor, positions: Tensor) -> Tensor:
        if not self.pre_rope:
            return keys
        from kvmem.rope import rotate

        return rotate(keys, positions.to(keys.device), self.inv_freq[self.layer].to(keys.device))

    @property
    def spec(self) -> str:
        given = dict(residual=self.residual, **{k: v for k, v in self.fit_params.items() if k in DEFAULTS})
        return format_spec(self.name, {k: v for k, v in given.items() if v != DEFAULTS[k]})


# -- fitting --------------------------------------------------------------------------------------------
@torch.no_grad()
def fit_codebooks(lm, sequences: int, length: int, samples: int, iters: int, fisher: bool, pre_rope: bool,
                  seed: int, channels: int, code_bits: int) -> dict[str, Tensor]:
    """Per layer, the codebooks `layer.{i}.keys` and `layer.{i}.values` (heads, head_dim / channels,
    2^code_bits, channels): k-means centroids of `samples` calibration rows (drawn with `seed` from
    `sequences` x `length` tokens of the shipped text), per KV head and group of `channels` contiguous
    channels, keys before RoPE with `pre_rope`. With `fisher`, each row's group is weighted by its diagonal
    Fisher information summed over the group's channels (the paper's Fisher-guided centroid learning)."""
    from kvmem.quant.calibrate import calibration_kv

    acts = calibration_kv(lm, sequences, length, fisher=fisher, pre_rope=pre_rope)
    n = acts[0].keys.shape[1]
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=gen)[:samples].sort().values  # the same tokens for every layer
    out = {}
    for i, a in enumerate(acts):
        for kind, x, f in (("keys", a.keys, a.key_fisher), ("values", a.values, a.value_fisher)):
            heads, _, dim = x.shape
            groups = dim // channels
            # (heads, S, dim) -> (heads * groups, S, channels)
            pts = x[:, rows.to(x.device)].float().cpu().reshape(heads, -1, groups, channels).permute(0, 2, 1, 3)
            w = None
            if fisher:
                w = f[:, rows.to(f.device)].float().cpu().reshape(heads, -1, groups, channels).sum(-1).permute(0, 2, 1)
                w = w.reshape(heads * groups, -1)
            books = kmeans(pts.reshape(heads * groups, -1, channels), 1 << code_bits, w, iters, seed + i)
            out[f"layer.{i}.{kind}"] = books.reshape(heads, groups, 1 << code_bits, channels)
    return out

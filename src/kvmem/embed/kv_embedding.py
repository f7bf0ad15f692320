"""`kv-embedding`: the last token's key/value states re-routed as a prefix every token attends to.

Tang & Yang 2026, "KV-Embedding: Training-free Text Embedding via Internal KV Re-routing in Decoder-only
LLMs" (arXiv 2601.01046; no official code). What the paper specifies, and what we do:
- a compression-oriented prompt (`TEMPLATE`) so the final token summarises rather than predicts;
- in each re-routing layer, the final token's K and V (computed in that layer, same forward pass) are
  prepended to the layer's keys and values, so every token, including early ones, can attend to a
  sequence summary; `bias` is added to the attention logit of that prefix slot (the paper's tunable bias);
- the embedding combines mean and last-token pooling of the final layer: here the average of the two
  L2-normalised vectors (the mean skips the first token, an attention sink; see `pooling.py`);
- the re-routing layers sit around the minimum of the intrinsic dimension (ID) of the representations,
  estimated per layer with TwoNN (Facco et al. 2017). `layers="id"` (the default) is that rule: the ID of
  the final-token states of the prompt over `ID_CALIBRATION` shipped abstracts; the ID profile of LMs rises
  to an early peak and falls to a minimum in the middle layers (Valeriani et al. 2023), so m is the lowest
  ID after the peak (the peak sought in the first half, the embeddings and last layer excluded), and we
  re-route in attention layers m-w..m+w, w = max(1, n_layers // 10). The paper gives neither the peak
  rule nor w; we chose them. Explicit layers, "all" or "none" (the ablation) can be passed instead.
Our choices where the paper is silent: the prefix key is re-rotated to RoPE position 0 and the text moved to
positions 1..T (a true prefix; attending to the unmodified key would put it at a "future" relative position,
which a causal model never saw), and padded batches use each row's last real token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from kvmem.embed.base import LMEmbedder, check_template, this_thread_only
from kvmem.embed.pooling import last_token, mean_pool
from kvmem.errors import KVMemError
from kvmem.rope import apply_rotation

TEMPLATE = 'Context: "{text}"\nCompress the context in one word:"'
ID_CALIBRATION = 200  # abstracts used to estimate each layer's intrinsic dimension
_ID_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its layers' IDs


def two_nn_dimension(x: np.ndarray, discard: float = 0.1) -> float:
    """TwoNN intrinsic dimension (Facco et al. 2017): the slope through the origin of -log(1 - F(mu)) against
    log(mu), mu = r2 / r1 the ratio of each point's two nearest-neighbour distances, largest `discard` dropped;
    NaN when fewer than 10 points have a nonzero nearest-neighbour distance."""
    x = np.asarray(x, dtype=np.float64)
    sq = (x * x).sum(1)
    dist = np.sqrt(np.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0.0))
    np.fill_diagonal(dist, np.inf)
    r = np.sort(dist, axis=1)[:, :2]
    mu = np.sort(r[r[:, 0] > 0, 1] / r[r[:, 0] > 0, 0])
    if len(mu) < 10:  # e.g. the token embeddings of one and the same final prompt token
        return float("nan")
    keep = int(len(mu) * (1 - discard))
    xs = np.log(mu[:keep])
    ys = -np.log(1 - np.arange(1, keep + 1) / len(mu))
    return float((xs * ys).sum() / (xs * xs).sum()) if (xs * xs).sum() > 0 else float("nan")


@dataclass
class ReRoute:
    """What the attention of one forward pass needs to re-route (passed as the `kvmem_reroute` kwarg)."""

    layers: frozenset[int]
    bias: float
    last: Tensor  # (B,) index of each row's final real token
    lengths: Tensor  # (B,) real tokens per row
    rope: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> (cos, sin), from a hook

    def attend(self, module, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> tuple[Tensor, None] | None:
        """Attention of a re-routing layer (None for the others: they run as usual)."""
        if module.layer_idx not in self.layers:
            return None
        B, _, T, _ = key.shape
        rows, dev = torch.arange(B, device=key.device), key.device
        cos, sin = self.rope[module.layer_idx]
        cos, sin = cos.expand(B, -1, -1)[rows, self.last, None], sin.expand(B, -1, -1)[rows, self.last, None]
        k_last = key[rows, :, self.last]  # (B, Hkv, D), rotated to its own position
        # undo that rotation (a rotation scaled by |cos, sin|): the key at position 0, where RoPE is the identity
        k_prefix = apply_rotation(k_last, cos, -sin) / (cos * cos + sin * sin).sqrt()
        keys = torch.cat((k_prefix[:, :, None], key), dim=2)
        values = torch.cat((value[rows, :, self.last][:, :, None], value), dim=2)

        i, j = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None, :]
        allowed = (j <= i)[None] & (j[None] < self.lengths[:, None, None])  # causal, right padding
        window = getattr(module, "sliding_window", None)
        if window:
            allowed &= (i - j < window)[None]
        mask = torch.zeros(B, T, T + 1, dtype=query.dtype, device=dev).masked_fill_(
            F.pad(~allowed, (1, 0)), float("-inf"))
        mask[:, :, 0] = self.bias  # the prefix slot: visible to every token, with the tunable bias
        groups = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, keys.repeat_interleave(groups, 1),
                                             values.repeat_interleave(groups, 1), attn_mask=mask[:, None],
                                             scale=scaling)
        return out.transpose(1, 2).contiguous(), None


class KVEmbedding(LMEmbedder):
    name = "kv-embedding"

    def __init__(self, model, tokenizer, layer: int = -1, layers: str | Sequence[int] = "id", bias: float = 0.0,
                 template: str = TEMPLATE):
        super().__init__(model, tokenizer, layer)
        self.template, self.bias = check_template(template, 1, self.name), float(bias)
        if layers == "id":
            self.reroute_layers = self.id_layers()
        elif layers == "all":
            self.reroute_layers = list(range(self.n_layers))
        elif layers == "none":  # the ablation: prompt and pooling without re-routing
            self.reroute_layers = []
        elif isinstance(layers, str):
            raise KVMemError(f"kv-embedding layers must be 'id', 'all', 'none' or layer numbers, got {layers!r}")
        else:
            self.reroute_layers = sorted({int(layers)} if isinstance(layers, int) else set(map(int, layers)))
            if not all(0 <= x < self.n_layers for x in self.reroute_layers):
                raise KVMemError(f"re-routing layers must lie in 0..{self.n_layers - 1}, got {self.reroute_layers}")

    def _texts(self, texts: list[str]) -> list[str]:
        return [self.template.format(text=t) for t in texts]

    def intrinsic_dimensions(self) -> list[float]:
        """TwoNN ID of the prompt's final-token state after each layer (index l = hidden_states[l]),
        over the first `ID_CALIBRATION` shipped abstracts, without re-routing."""
        from kvmem.calibration import load_abstracts

        texts = list(load_abstracts())[:ID_CALIBRATION]
        states: list[list[Tensor]] = [[] for _ in range(self.n_layers + 1)]
        with torch.no_grad():
            for i in range(0, len(texts), 8):
                batch = self._tokenize(texts[i:i + 8])
                hidden = super()._hidden_states(batch)
                last = batch["attention_mask"].sum(1) - 1
                for layer, h in enumerate(hidden):
                    states[layer].append(h[torch.arange(len(h)), last].float())
        return [two_nn_dimension(torch.cat(s).numpy()) for s in states]

    def id_layers(self) -> list[int]:
        """The paper's rule: attention layers m-w..m+w around the ID minimum m (see the module doc)."""
        if self.model not in _ID_MEMO:  # ~90 s on 2 CPU cores: once per model and process
            _ID_MEMO[self.model] = self.intrinsic_dimensions()
        ids = np.array(_ID_MEMO[self.model][:self.n_layers])
        ids[0] = np.nan  # the token embeddings: nothing is compressed yet
        peak = int(np.nanargmax(ids[:self.n_layers // 2 + 1]))
        m = peak + int(np.nanargmin(ids[peak:]))
        w = max(1, self.n_layers // 10)
        return list(range(max(0, m - w), min(self.n_layers, m + w + 1)))

    def _hidden_states(self, batch) -> tuple[Tensor, ...]:
        body, mask = self.model.base_model, batch["attention_mask"]
        reroute = ReRoute(frozenset(self.reroute_layers), self.bias, mask.sum(1) - 1, mask.sum(1))

        def keep_rope(layer_idx: int):
            def hook(module, args, kwargs):
                reroute.rope[layer_idx] = kwargs["position_embeddings"]
            return hook

        handles = [body.layers[i].self_attn.register_forward_pre_hook(this_thread_only(keep_rope(i)), with_kwargs=True)
                   for i in self.reroute_layers]
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)[None]  # position 0 is the prefix slot's
        try:
            return body(input_ids=batch["input_ids"], attention_mask=mask, position_ids=positions,
                        output_hidden_states=True, use_cache=False, kvmem_reroute=reroute).hidden_states
        finally:
            for h in handles:
                h.remove()

    def _pool(self, hidden: Tensor, mask: Tensor, batch, texts: list[str]) -> Tensor:
        mean = mean_pool(hidden, mask)  # the first token, an attention sink, left out as in `mean`
        return (F.normalize(mean, dim=-1) + F.normalize(last_token(hidden, mask), dim=-1)) / 2

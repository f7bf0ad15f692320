"""Selective recompute over slot K/V (the machinery of `blend.py`'s CacheBlend and infoflow, and of `semshare.py`):
every prompt slot holds a K/V row (placed from the store, or empty), the chosen tokens run through the decoder layers
writing their fresh K/V into their slots while attending, causally by position, to every slot; at a check layer a
`choose` (e.g. `DeviationChoice`, CacheBlend's high-KV-deviation tokens) may narrow the tokens that go on.

Compute is counted in token-layers: one token through one decoder layer (`run_layers`'s per-layer counts)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from kvmem.attention import visible
from kvmem.cache import KVCache
from kvmem.models import LoadedModel
from kvmem.rows import ExportedRows

KV = list[tuple[Tensor, Tensor]]  # per layer keys and values (KV heads, slots, head_dim), one slot per prompt token


class _Slots:
    """One layer's K/V of every prompt slot, read by transformers' attention as its cache: the tokens run now
    write their fresh K/V into their slots (`choose` may keep only some) and attention reads all slots. With
    `observe`, it is also kvmem attention's callback (`kvmem_layer`) and keeps the queries."""

    def __init__(self, keys: Tensor, values: Tensor, active: Tensor, choose=None, observe: bool = False):
        self.keys, self.values, self.active, self.choose, self.watch = keys, values, active, choose, observe
        self.kept: Tensor | None = None
        self.query: tuple[Tensor, float] | None = None
        self.observation = SimpleNamespace(track_attention=False)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, kwargs: dict | None = None, **_):
        k, v, slots = key_states[0], value_states[0], self.active
        if self.choose is not None:
            self.kept = self.choose(v, self.values[:, slots])
            k, v, slots = k[:, self.kept], v[:, self.kept], slots[self.kept]
        self.keys[:, slots], self.values[:, slots] = k, v
        if self.watch and kwargs is not None:
            kwargs["kvmem_layer"] = self
        return self.keys[None], self.values[None]

    def observe(self, query: Tensor, scaling: float) -> None:
        self.query = (query[0], scaling)


class DeviationChoice:
    """CacheBlend's selection at the check layer (a `choose` for `run_layers`): among the active tokens marked
    `candidates`, the k whose fresh values deviate most from the cached ones (squared L2 over KV heads and channels:
    the high-KV-deviation tokens) go on through the next layers; every active token that is not a candidate goes on
    too. `picked`: the chosen candidates, as indices into the active tokens."""

    def __init__(self, candidates: Tensor, k: int):
        self.candidates, self.k = candidates, k
        self.picked: Tensor | None = None

    def __call__(self, fresh: Tensor, cached: Tensor) -> Tensor:
        deviation = ((fresh - cached) ** 2).sum((0, 2)).masked_fill(~self.candidates, float("-inf"))
        self.picked = deviation.topk(self.k).indices
        keep = ~self.candidates
        keep[self.picked] = True
        return keep


def text_config(lm: LoadedModel):  # the decoder's config
    return lm.model.config.get_text_config()


def empty_kv(lm: LoadedModel, n: int) -> KV:
    cfg, p = text_config(lm), next(lm.model.parameters())
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_key_value_heads, n, dim)
    return [(p.new_zeros(shape), p.new_zeros(shape)) for _ in range(cfg.num_hidden_layers)]


@torch.no_grad()
def run_layers(lm: LoadedModel, kv: KV, positions: Tensor, ids: Tensor, active: Tensor, choose_at: int | None = None,
               choose=None, observe: bool = False) -> tuple[Tensor, list[int], list]:
    """Run the prompt slots `active` (increasing) through every decoder layer over the slot K/V `kv` (updated in
    place); at layer `choose_at`, `choose(fresh values, cached values)` says which active tokens go on. Returns the
    last active token's logits, the tokens computed per layer and (with `observe`) each layer's (queries, scaling)."""
    model, types = lm.model.model, getattr(text_config(lm), "layer_types", None)
    h = model.embed_tokens(ids[active][None])
    counts, queries = [], []
    for i, layer in enumerate(model.layers):
        slots = _Slots(*kv[i], active, choose if i == choose_at else None, observe)
        pos = positions[active]
        by_type = types is not None and hasattr(model.rotary_emb, f"{types[i]}_inv_freq")
        rope = model.rotary_emb(h, pos[None], types[i]) if by_type else model.rotary_emb(h, pos[None])
        mask = visible(positions[None], pos, getattr(layer.self_attn, "sliding_window", None))[None]
        h = layer(h, attention_mask=mask, position_ids=pos[None], cache=slots, position_embeddings=rope)
        counts.append(int(active.numel()))
        queries.append(slots.query)
        if slots.kept is not None:
            h, active = h[:, slots.kept], active[slots.kept]
    logits = lm.model.lm_head(model.norm(h[:, -1:]))[0, -1]
    cap = getattr(text_config(lm), "final_logit_softcapping", None)
    return (torch.tanh(logits / cap) * cap if cap else logits), counts, queries


def to_cache(lm: LoadedModel, kv: KV, positions: Tensor) -> KVCache:
    """A kvmem cache holding the slots: every row, or a sliding layer's last window - 1 (what it would hold)."""
    cache, n = KVCache(lm.model.config), positions.numel()
    for layer, (keys, values) in zip(cache.layers, kv):
        keep = slice(max(n - layer.sliding_window + 1, 0) if layer.is_sliding else 0, n)
        layer.import_rows(ExportedRows([{"keys": keys[h, keep], "values": values[h, keep],
                                         "positions": positions[keep].to(torch.int32)} for h in range(keys.shape[0])]))
    return cache



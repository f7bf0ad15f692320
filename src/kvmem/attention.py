"""Attention that reads kvmem's storage, registered with transformers as `attn_implementation="kvmem"`.

A layer whose positions are still the contiguous range transformers assumes runs transformers' own SDPA
with the model's mask (bit-identical to an uncompressed cache), except a quantized layer's decode step, which
needs no mask and reads its decoded rows here (GQA without repeat_kv's copy). A compressed layer passes its own mask,
built from the original positions of the rows it holds (causal, sliding window, rows standing for several
tokens), or none when every query may see every row (a decode step, usually):

* `kvmem_mask`: dense storage; (1, H, Q, T) bool or additive float, or None.
* `kvmem_heads`: ragged storage; per KV head (keys, values, mask or None), attended head by head on the
  exact rows, nothing padded.
* `kvmem_layer`: the layer to call back with the queries (observation for the scorers, see `observe.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvmem.errors import KVMemError

ATTENTION_NAME = "kvmem"


def visible(key_pos: Tensor, query_pos: Tensor, sliding_window: int | None) -> Tensor:
    """Bool (heads, queries, keys) from key positions (heads, keys): causal, within the sliding window."""
    qp, kp = query_pos[None, :, None], key_pos[:, None, :]
    allowed = kp <= qp
    if sliding_window is not None:
        allowed &= (qp - kp) < sliding_window
    return allowed


def sees_all(key_pos: Tensor, query_pos: Tensor, sliding_window: int | None) -> bool:
    """Whether every query at `query_pos` may attend every row at `key_pos` (no mask needed)."""
    return bool(key_pos.numel()) and int(key_pos.max()) <= int(query_pos.min()) and (
        sliding_window is None or int(key_pos.min()) > int(query_pos.max()) - sliding_window)


def rows_mask(key_pos: Tensor, query_pos: Tensor, sliding_window: int | None,
              log_weights: Tensor | None = None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """The mask of queries at `query_pos` (Q,) over rows at `key_pos` (heads, T): None when every query sees
    every row; bool (heads, Q, T); or, with row log-weights (heads, T), additive: log-weight where visible,
    -inf elsewhere."""
    if log_weights is None and sees_all(key_pos, query_pos, sliding_window):
        return None
    allowed = visible(key_pos, query_pos, sliding_window)
    if log_weights is None:
        return allowed
    return torch.where(allowed, log_weights[:, None, :].to(dtype), torch.tensor(float("-inf"), dtype=dtype))


def kvmem_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs):
    """SDPA, with the rows and mask of a compressed kvmem layer when there is one, plus observation
    (or kv-embedding's re-routed prefix in the layers it asks for)."""
    own_mask = "kvmem_mask" in kwargs
    mask = kwargs.pop("kvmem_mask", None)
    heads = kwargs.pop("kvmem_heads", None)  # a layer whose heads hold different numbers of rows
    layer = kwargs.pop("kvmem_layer", None)
    reroute = kwargs.pop("kvmem_reroute", None)  # kv-embedding's prefix slot (kvmem.embed.kv_embedding)
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if reroute is not None and (out := reroute.attend(module, query, key, value, scaling)) is not None:
        return out
    if layer is not None and layer.observation.track_attention:  # the layer attends itself, keeping the weights
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported with track_attention")
        return layer.observe(query, scaling), None
    if not own_mask and heads is None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    else:
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported on compressed kvmem layers")
        if heads is None:
            out = (grouped_attention(query, key, value, mask, scaling), None)
        else:
            out = (torch.cat([grouped_attention(q, k[None, None], v[None, None], None if m is None else m[None, None], scaling)
                              for q, (k, v, m) in zip(query.chunk(len(heads), dim=1), heads)], dim=2), None)
    if layer is not None:
        layer.observe(query, scaling)
    return out


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float) -> Tensor:
    """SDPA of query heads (B, Hq, Q, D) over KV heads (B, Hkv, T, D), with an optional per-KV-head mask
    (B, Hkv, Q, T). The query heads sharing a KV head are stacked as extra query rows, so keys and values
    are read in place (no repeat per query head). Returns (B, Q, Hq, D)."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    q = query.reshape(b, hkv, groups * q_len, d)
    if mask is not None:
        mask = mask[:, :, None].expand(b, hkv, groups, q_len, mask.shape[-1]).reshape(b, hkv, groups * q_len, -1)
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return o.reshape(b, hq, q_len, -1).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION_NAME, kvmem_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

"""Attention that reads kvmem's storage, registered with transformers as `attn_implementation="kvmem"`.

A layer whose positions are still the contiguous range transformers assumes runs transformers' own SDPA
with the model's mask (bit-identical to an uncompressed cache), except a quantized layer's decode step, which
needs no mask and reads its decoded rows here (GQA without repeat_kv's copy). A compressed layer passes its own mask,
built from the original positions of the rows it holds (causal, sliding window, rows standing for several
tokens), or none when every query may see every row (a decode step, usually):

* `kvmem_mask`: dense storage; (1, H, Q, T) bool or additive float, or None.
* `kvmem_heads`: ragged storage; per KV head (keys, values, mask or None), attended head by head on the
  exact rows, nothing padded.
* `kvmem_flat`: heads of different lengths decoded onto one row axis (a quantized layer, `QuantizedRows.flat`): keys
  and values (1, 1, N, D) and which rows each KV head's queries see, (H, Q, N) bool; one attention call.
* `kvmem_decode`: a decode step's rows read in place by the decode kernel (`kvmem.kernel`; quantized rows' codes,
  nothing decoded, or an evicted layer's full-precision heads): `attend_in_place`.
* `kvmem_offload`: an offloaded layer's rows and the new positions (`compress/offload/rows.py`): the rows retrieve
  what the queries need from their tier, then attend their resident working set (`OffloadedRows.attend`).
* `kvmem_layer`: the layer to call back with the queries (observation for the scorers, see `observe.py`).
* `kvmem_rows`: a `RowBatch` (`batch.py`); per sequence (keys, values, its own kwargs of the above), attended
  sequence by sequence, each on its own rows, except the sequences read in place (`kvmem_decode`: in a batch, a
  decode step's float32 rows too, compressed or not): one kernel call.
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
    rows = kwargs.pop("kvmem_rows", None)  # a RowBatch: each sequence attends its own cache (kvmem.batch)
    if rows is not None:
        in_place = _rows_in_place(query, rows, scaling, kwargs)
        return torch.cat([in_place[b] if b in in_place else
                          kvmem_attention(module, query[b:b + 1], k, v, own.pop("attention_mask", None), dropout, scaling,
                                          **(kwargs | own))[0] for b, (k, v, own) in enumerate(rows)]), None
    if (offload := kwargs.pop("kvmem_offload", None)) is not None:
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported on offloaded kvmem layers")
        return offload[0].attend(query, offload[1], scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])), None
    own_mask = "kvmem_mask" in kwargs
    mask = kwargs.pop("kvmem_mask", None)
    heads = kwargs.pop("kvmem_heads", None)  # a layer whose heads hold different numbers of rows
    flat = kwargs.pop("kvmem_flat", None)  # the same, decoded onto one row axis
    in_place = kwargs.pop("kvmem_decode", None)  # quantized rows read by their decode kernel
    layer = kwargs.pop("kvmem_layer", None)
    kwargs.pop("kvmem_batched", None)  # read by the cache's layer (a RowBatch's row), not here
    reroute = kwargs.pop("kvmem_reroute", None)  # kv-embedding's prefix slot (kvmem.embed.kv_embedding)
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if reroute is not None and (out := reroute.attend(module, query, key, value, scaling)) is not None:
        return out
    if layer is not None and layer.observation.track_attention:  # the layer attends itself, keeping the weights
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported with track_attention")
        return layer.observe(query, scaling), None
    if in_place is not None:
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported on compressed kvmem layers")
        out = (attend_in_place([in_place], query[:, :, 0], scaling)[:, None], None)
    elif flat is not None:
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported on compressed kvmem layers")
        out = (flat_attention(query, key, value, flat, scaling), None)
    elif not own_mask and heads is None:
        window = kwargs.get("sliding_window")
        if window and query.shape[0] == 1 and query.shape[2] >= 2 * WINDOW_BLOCK and kwargs.get("softcap") is None \
                and standard_window_mask(attention_mask, query.shape[2], key.shape[2], window):
            out = (windowed_attention(query, key, value, window, scaling), None)
        elif grouped_sdpa_applies(module, query, key, attention_mask, kwargs):
            out = grouped_sdpa(query, key, value, attention_mask, dropout, scaling)
        else:
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


def grouped_sdpa_applies(module, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict) -> bool:
    """Whether transformers' SDPA would copy every KV head for each query head of its group (`repeat_kv`: a masked
    forward of several tokens over grouped-query heads) where `grouped_sdpa` gives the same output."""
    return (mask is not None and mask.dtype == torch.bool and query.shape[2] > 1 and key.shape[1] < query.shape[1]
            and getattr(module, "num_key_value_groups", 1) > 1 and kwargs.get("softcap") is None
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions"))


def grouped_sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, dropout: float, scaling: float):
    """transformers' SDPA path with SDPA's own grouped-query heads instead of `repeat_kv`: the same bits on CPU
    (tests/test_models.py checks it against DynamicCache), without copying the keys and values three times over.
    13 question tokens over 4k stored rows of SmolLM2: ~40 ms of a ~180 ms forward was that copy."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def attend_in_place(rows: list, query: Tensor, scaling: float) -> Tensor:
    """A decode step of B sequences, query (B, Hq, D), each over its layer's rows (`kvmem.rows.Rows`, all visible) read
    in place by the decode kernel: rows of one kind (`kernel_key`: full precision, or a scheme's bits and groups) in
    one call, parallel over sequences and heads. Returns (B, Hq, D)."""
    calls: dict[tuple, list[int]] = {}
    for b, r in enumerate(rows):
        calls.setdefault(r.kernel_key(), []).append(b)
    if len(calls) == 1:
        return rows[0].attend_kernel(query, [r.kernel_rows() for r in rows], scaling)
    out = torch.empty_like(query)
    for index in calls.values():
        out[index] = rows[index[0]].attend_kernel(query[index], [rows[b].kernel_rows() for b in index], scaling)
    return out


def _rows_in_place(query: Tensor, rows: list, scaling: float | None, kwargs: dict) -> dict[int, Tensor]:
    """A RowBatch's decode step over the sequences whose rows are read in place (`kvmem_decode`): all of them in one
    kernel call per kind (`attend_in_place`) rather than one per sequence. {b: (1, 1, Hq, D)}."""
    batch = [b for b, (_, _, own) in enumerate(rows) if "kvmem_decode" in own]
    if not batch:
        return {}
    if kwargs.get("softcap") is not None:
        raise KVMemError("attention logit soft-capping is not supported on compressed kvmem layers")
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    queries = query[batch, :, 0] if len(batch) < len(rows) else query[:, :, 0]
    out = attend_in_place([rows[b][2]["kvmem_decode"] for b in batch], queries, scaling)
    for i, b in enumerate(batch):
        if (layer := rows[b][2].get("kvmem_layer")) is not None:  # encodes the residual rows that fill a block
            layer.observe(query[b:b + 1], scaling)
    return {b: out[i:i + 1, None] for i, b in enumerate(batch)}


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


def flat_attention(query: Tensor, key: Tensor, value: Tensor, allowed: Tensor, scaling: float) -> Tensor:
    """SDPA of query heads (1, Hq, Q, D) over every KV head's rows on one axis (1, 1, N, D), each query head seeing
    the rows its KV head may (allowed: (Hkv, Q, N) bool): one call where heads hold different numbers of rows, instead
    of one per head. Every query head reads all N rows (masked), which costs little when decoding: the rows are read
    from memory once either way. Returns (1, Q, Hq, D)."""
    _, hq, q_len, d = query.shape
    mask = allowed.repeat_interleave(hq // allowed.shape[0], dim=0).reshape(1, 1, hq * q_len, -1)
    o = F.scaled_dot_product_attention(query.reshape(1, 1, hq * q_len, d), key, value, attn_mask=mask, scale=scaling)
    return o.reshape(1, hq, q_len, -1).transpose(1, 2).contiguous()


WINDOW_BLOCK = 512  # queries per block of a long sliding-window forward


def standard_window_mask(mask: Tensor | None, q_len: int, t: int, window: int) -> bool:
    """Whether the model's mask (1, 1, Q, T) is the plain causal sliding-window mask of the last Q of T contiguous
    positions (no padding): its first and last query rows are checked, O(T), never the whole (Q, T)."""
    if mask is None or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[-2:] != (q_len, t):
        return False
    rows = mask[0, :, [0, q_len - 1]]
    allowed = rows if rows.dtype == torch.bool else rows == 0
    positions = torch.arange(t, device=mask.device)
    want = visible(positions[None], positions[[t - q_len, t - 1]], window)
    return bool((allowed == want).all())


def windowed_attention(query: Tensor, key: Tensor, value: Tensor, window: int, scaling: float) -> Tensor:
    """Causal sliding-window attention of the last Q of T contiguous positions (batch 1), block by block: each
    block of queries reads only the keys inside its window. SDPA with the model's (Q, T) mask computes every
    pair and masks most of them, so this is ~T / (window + block) times less work at long prefills. Returns
    (1, Q, Hq, D)."""
    q_len, t = query.shape[2], key.shape[2]
    offset = t - q_len  # query i stands at position offset + i
    out = query.new_empty(1, q_len, query.shape[1], value.shape[-1])
    for s in range(0, q_len, WINDOW_BLOCK):
        e = min(q_len, s + WINDOW_BLOCK)
        k0, k1 = max(0, offset + s - window + 1), offset + e
        mask = visible(torch.arange(k0, k1, device=key.device)[None], torch.arange(offset + s, offset + e,
                                                                                   device=key.device), window)
        out[:, s:e] = grouped_attention(query[:, :, s:e], key[:, :, k0:k1], value[:, :, k0:k1], mask[None], scaling)
    return out


AttentionInterface.register(ATTENTION_NAME, kvmem_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)

"""kvmem's KV cache: per-head variable-length storage that keeps each token's original position.

The engine's contract (also in the README):

* `KVCache` is a transformers `Cache`. Pass it as `cache=` to a model loaded by `kvmem.load_model`
  (forward or `model.generate`); nothing in transformers is patched.
* Each layer stores, per KV head `h`: `keys[h]` and `values[h]` of shape (T_h, head_dim) and
  `positions[h]` (T_h,) int32. Heads may hold different numbers of tokens: that is real storage,
  the evicted rows are gone.
* Keys are stored after RoPE at their original positions and never re-rotated; new tokens continue
  at the next original position. (Convention "keep original positions", as kvpress/SnapKV do.)
* Until a layer is compressed it returns exactly what transformers' DynamicLayer /
  DynamicSlidingWindowLayer would, and the model's own mask is used: output is bit-identical.
  Once compressed, the layer builds its own per-head mask from positions (causal, sliding window,
  padding of shorter heads) and hands it to kvmem's attention function through the attention kwargs.
* Scorers need what attention saw: each layer keeps the last `observe_window` queries (and their
  positions) and, with `track_attention=True`, the attention each kept token has received (H2O).
* `kv_bytes()` sums the storage actually held by key and value tensors; positions and observation
  state are reported separately by `state_bytes()`.

A sequence is one batch row: kvmem caches hold batch size 1.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvmem.errors import KVMemError

ATTENTION_NAME = "kvmem"
_QUERY_CHUNK = 256  # queries per block when accumulating attention (bounds memory at long context)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view of a big tensor counts the big tensor)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


_GROW = 64  # free rows added when a buffer fills: appends stay amortized, spare capacity stays small


class KVLayer(CacheLayerMixin):
    """One attention layer's cache, stored per KV head.

    Storage: while every head holds the same number of tokens, one buffer (heads, capacity, head_dim)
    whose live rows attention reads without a copy; once heads differ (per-head budgets), one buffer
    per head of its own length. Either way `kv_bytes` measures exactly what is allocated.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, sliding_window: int | None = None, observe_window: int = 64, track_attention: bool = False,
                 layer_idx: int = 0, compressor=None):
        self.is_initialized = False
        self.layer_idx = layer_idx
        self.compressor = compressor  # called after each forward's attention (see compress.Compressor)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.observe_window = observe_window
        self.track_attention = track_attention
        self.compressed = False  # True once positions are no longer the contiguous range transformers assumes
        self.next_position = 0
        self._k: Tensor | list[Tensor] | None = None  # dense (H, cap, D) or per-head [(cap_h, D)]
        self._v: Tensor | list[Tensor] | None = None
        self._p: Tensor | list[Tensor] | None = None  # int32 positions, (H, cap) or per-head [(cap_h,)]
        self._n: list[int] = []  # live rows per head
        self.head_attention: list[Tensor] | None = None  # per head (query group, T_h), with track_attention
        # Per head (T_h,): log of how many tokens a row stands for, added to its attention logit. None: every row
        # is one token. RazorAttention's compensation rows (the mean of n dropped tokens) carry log(n).
        self.log_weights: list[Tensor] | None = None
        self.recent_queries: Tensor | None = None  # (query heads, <= observe_window, head_dim)
        self.recent_positions: Tensor | None = None
        self.scaling: float | None = None  # the model's attention scaling, seen by observe()
        # What the current forward's attention sees, per head (keys, values, positions) and the new tokens'
        # positions; set by update(), read by observe() and the compressor it calls, then released.
        self.seen: tuple | None = None

    # -- storage -------------------------------------------------------------------------------------
    @property
    def dense(self) -> bool:
        return isinstance(self._k, Tensor)

    @property
    def num_heads(self) -> int:
        return len(self._n)

    def lengths(self) -> list[int]:
        return list(self._n)

    @property
    def head_keys(self) -> list[Tensor]:
        return [self._k[h, :n] if self.dense else self._k[h][:n] for h, n in enumerate(self._n)]

    @property
    def head_values(self) -> list[Tensor]:
        return [self._v[h, :n] if self.dense else self._v[h][:n] for h, n in enumerate(self._n)]

    @property
    def head_positions(self) -> list[Tensor]:
        return [self._p[h, :n] if self.dense else self._p[h][:n] for h, n in enumerate(self._n)]

    def _set_rows(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor], spare: int = 0) -> None:
        """Store exactly these rows per head (plus `spare` free rows): dense if all heads are equally long."""
        self._n = [k.shape[0] for k in keys]
        if len(set(self._n)) == 1:
            n = self._n[0]
            self._k = keys[0].new_empty((len(keys), n + spare, keys[0].shape[-1]))
            self._v = values[0].new_empty((len(values), n + spare, values[0].shape[-1]))
            self._p = positions[0].new_empty((len(positions), n + spare))
            for h in range(len(keys)):
                self._k[h, :n], self._v[h, :n], self._p[h, :n] = keys[h], values[h], positions[h]
        else:
            def exact(rows: Tensor) -> Tensor:
                buf = rows.new_empty((rows.shape[0] + spare, *rows.shape[1:]))
                buf[: rows.shape[0]] = rows
                return buf
            self._k, self._v, self._p = [exact(k) for k in keys], [exact(v) for v in values], [exact(p) for p in positions]

    def _append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Append `keys`/`values` (H, Q, D) at `positions` (Q,) to every head, growing buffers by _GROW."""
        q = keys.shape[1]
        grow = q + (_GROW if max(self._n) else 0)  # a prefill into an empty layer is stored exactly
        if self.dense:
            n = self._n[0]
            if n + q > self._k.shape[1]:
                self._set_rows(self.head_keys, self.head_values, self.head_positions, spare=grow)
            self._k[:, n:n + q], self._v[:, n:n + q], self._p[:, n:n + q] = keys, values, positions
        else:
            if any(n + q > k.shape[0] for n, k in zip(self._n, self._k)):
                self._set_rows(self.head_keys, self.head_values, self.head_positions, spare=grow)
            for h, n in enumerate(self._n):
                self._k[h][n:n + q], self._v[h][n:n + q], self._p[h][n:n + q] = keys[h], values[h], positions
        self._n = [n + q for n in self._n]
        if self.head_attention is not None:  # new tokens start with no accumulated attention
            self.head_attention = [torch.cat([a, a.new_zeros((a.shape[0], q))], dim=1) for a in self.head_attention]
        if self.log_weights is not None:  # new tokens are one token each
            self.log_weights = [torch.cat([w, w.new_zeros(q)]) for w in self.log_weights]

    def _trim_to_window(self) -> None:
        """A sliding layer keeps what the next token can still see: positions > next - window (transformers
        keeps the last window-1 tokens; the same set while uncompressed). Copied so dropped rows are freed."""
        cutoff = self.next_position - self.sliding_window
        drop = [int((p <= cutoff).sum()) for p in self.head_positions]  # positions increase: a prefix
        if not any(drop):
            return
        self._set_rows([k[d:] for k, d in zip(self.head_keys, drop)], [v[d:] for v, d in zip(self.head_values, drop)],
                       [p[d:] for p, d in zip(self.head_positions, drop)])
        if self.head_attention is not None:
            self.head_attention = [a[:, d:].clone() for a, d in zip(self.head_attention, drop)]
        if self.log_weights is not None:
            self.log_weights = [w[d:].clone() for w, d in zip(self.log_weights, drop)]

    # -- transformers' layer interface -------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        n_heads = key_states.shape[1]
        self._k = key_states.new_empty((n_heads, 0, key_states.shape[-1]))
        self._v = value_states.new_empty((n_heads, 0, value_states.shape[-1]))
        self._p = torch.empty((n_heads, 0), dtype=torch.int32, device=self.device)
        self._n = [0] * n_heads
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: dict | None = None, **_) -> tuple[Tensor, Tensor]:
        if key_states.shape[0] != 1:
            raise KVMemError(f"a kvmem cache holds one sequence; got batch size {key_states.shape[0]}")
        if kwargs is None:
            raise KVMemError("this model does not pass its attention kwargs to the cache; kvmem cannot drive it")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[2]
        position_ids = kwargs.get("position_ids")
        if position_ids is not None:
            new_pos = position_ids.reshape(-1)[-n_new:].to(device=self.device, dtype=torch.int32)
        else:
            new_pos = torch.arange(self.next_position, self.next_position + n_new, dtype=torch.int32, device=self.device)
        if int(new_pos[0]) != self.next_position:
            self.compressed = True
        self._append(key_states[0], value_states[0], new_pos)
        self.next_position = max(self.next_position, int(new_pos.max()) + 1)
        # What attention sees, taken before a sliding layer drops what later tokens cannot see.
        observing = self.observe_window > 0 or self.track_attention
        heads = (self.head_keys, self.head_values, self.head_positions) if observing or not self.dense else None
        if self.dense:  # live rows of the shared buffer: no copy
            n = self._n[0]
            keys, values = self._k[None, :, :n], self._v[None, :, :n]
            if self.compressed:
                lw = torch.stack(self.log_weights) if self.log_weights is not None else None
                kwargs["kvmem_mask"] = self._mask(self._p[:, :n], new_pos, lw)[None]
        else:  # heads of different lengths: attention runs per KV head on its exact rows (nothing padded)
            lws = self.log_weights or [None] * self.num_heads
            kwargs["kvmem_heads"] = [(k, v, self._mask(p[None], new_pos, None if w is None else w[None])[0])
                                     for k, v, p, w in zip(*heads, lws)]
            keys, values = heads[0][0][None, None], heads[1][0][None, None]  # unread: kvmem_heads is used
        if self.is_sliding:
            self._trim_to_window()
        if observing:
            kwargs["kvmem_layer"] = self
            self.seen = (*heads, new_pos)
        return keys, values

    def _allowed(self, key_pos: Tensor, query_pos: Tensor) -> Tensor:
        """Bool (heads, queries, keys): causal by original position, within the sliding window."""
        qp, kp = query_pos[None, :, None], key_pos[:, None, :]
        allowed = kp <= qp
        if self.is_sliding:
            allowed &= (qp - kp) < self.sliding_window
        return allowed

    def _mask(self, key_pos: Tensor, query_pos: Tensor, log_weights: Tensor | None) -> Tensor:
        """`_allowed`, or with row weights (heads, keys) an additive float mask: log-weight where allowed, -inf elsewhere."""
        allowed = self._allowed(key_pos, query_pos)
        if log_weights is None:
            return allowed
        return torch.where(allowed, log_weights[:, None, :].to(self.dtype), torch.tensor(float("-inf"), dtype=self.dtype))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.compressed:  # kvmem builds this layer's mask itself; transformers' one is unused
            return max(self._n or [0]) + query_length, 0
        if self.is_sliding:  # mirror DynamicSlidingWindowLayer exactly
            kv_offset = max(self.next_position - self.sliding_window + 1, 0)
            return min(self.next_position, self.sliding_window - 1) + query_length, kv_offset
        return self.next_position + query_length, 0

    def get_seq_length(self) -> int:
        return self.next_position

    def get_max_length(self) -> int:
        return self.sliding_window or -1

    def reset(self) -> None:
        self.__init__(self.sliding_window, self.observe_window, self.track_attention, self.layer_idx, self.compressor)

    def reorder_cache(self, beam_idx) -> None:
        raise KVMemError("kvmem caches hold one sequence; beam search is not supported")

    # -- observation, for scorers --------------------------------------------------------------------
    def observe(self, query: Tensor, scaling: float) -> Tensor | None:
        """Record what scorers need from this forward's queries (called by kvmem's attention). With
        `track_attention`, attention is computed here, explicitly, so that the weights it needs anyway are
        also summed per key (H2O's accumulated attention); the output is returned, (1, Q, heads, head_dim)."""
        full_k, full_v, full_p, new_pos = self.seen
        self.scaling = scaling
        q = query[0].detach()  # (query heads, new tokens, head_dim)
        if self.observe_window > 0:
            prev_q = self.recent_queries if self.recent_queries is not None else q[:, :0]
            prev_p = self.recent_positions if self.recent_positions is not None else new_pos[:0]
            self.recent_queries = torch.cat([prev_q, q[:, -self.observe_window:]], dim=1)[:, -self.observe_window:].clone()
            self.recent_positions = torch.cat([prev_p, new_pos[-self.observe_window:]])[-self.observe_window:].clone()
        out = self._attend_and_accumulate(q, scaling, full_k, full_v, full_p, new_pos) if self.track_attention else None
        if self.compressor is not None:
            self.compressor(self, self.layer_idx)
        self.seen = None
        return out

    def _attend_and_accumulate(self, q: Tensor, scaling: float, full_k, full_v, full_p, new_pos) -> Tensor:
        """Softmax attention per KV head in blocks of queries, over the keys each block can see; returns the
        output and adds each key's received attention (summed over queries) to `head_attention`."""
        groups = q.shape[0] // self.num_heads
        if self.head_attention is None:
            self.head_attention = [q.new_zeros((groups, n)) for n in self._n]
        out = q.new_empty((q.shape[0], q.shape[1], full_v[0].shape[-1]))
        for h in range(self.num_heads):
            k, v, kp = full_k[h], full_v[h], full_p[h]  # positions increase along a head: visible keys are a range
            acc = q.new_zeros((groups, k.shape[0]))
            rows = slice(h * groups, (h + 1) * groups)
            for start in range(0, q.shape[1], _QUERY_CHUNK):
                block = slice(start, start + _QUERY_CHUNK)
                qp = new_pos[block]
                hi = int(torch.searchsorted(kp, qp.max(), right=True))
                lo = int(torch.searchsorted(kp, qp.min() - self.sliding_window, right=True)) if self.is_sliding else 0
                scores = torch.matmul(q[rows, block], k[lo:hi].T) * scaling
                scores.masked_fill_(~self._allowed(kp[None, lo:hi], qp)[0][None], float("-inf"))
                if self.log_weights is not None:
                    scores += self.log_weights[h][lo:hi]
                weights = scores.softmax(dim=-1)
                out[rows, block] = torch.matmul(weights, v[lo:hi])
                acc[:, lo:hi] += weights.sum(dim=1)
            stored = self.head_attention[h].shape[1]  # stored tokens are the suffix of what attention saw
            self.head_attention[h] = self.head_attention[h] + acc[:, acc.shape[1] - stored:]
        return out.transpose(0, 1)[None]

    # -- eviction ------------------------------------------------------------------------------------
    def keep_only(self, indices: list[Tensor]) -> None:
        """Keep, for each head, the tokens at `indices[h]` (sorted, so positions stay increasing). The kept
        rows are copied into exactly-sized storage and the old buffers are released."""
        idx = [i.sort().values.to(self.device) for i in indices]
        self._set_rows([k.index_select(0, i) for k, i in zip(self.head_keys, idx)],
                       [v.index_select(0, i) for v, i in zip(self.head_values, idx)],
                       [p.index_select(0, i) for p, i in zip(self.head_positions, idx)])
        if self.head_attention is not None:
            self.head_attention = [a.index_select(1, i) for a, i in zip(self.head_attention, idx)]
        if self.log_weights is not None:
            self.log_weights = [w.index_select(0, i) for w, i in zip(self.log_weights, idx)]
        self.compressed = True

    def add_rows(self, rows: list[tuple[Tensor, Tensor, int, float] | None]) -> None:
        """Insert one row per head (key, value, position, log-weight), or nothing where None, in position order.
        The position must be one the head does not hold (e.g. a dropped token's); it has received no attention."""
        keys, values, positions = self.head_keys, self.head_values, self.head_positions
        weights = self.log_weights or [k.new_zeros(k.shape[0]) for k in keys]
        attention = self.head_attention or [None] * len(keys)
        out: tuple[list, ...] = ([], [], [], [], [])
        for h, row in enumerate(rows):
            k, v, p, w, a = keys[h], values[h], positions[h], weights[h], attention[h]
            if row is not None:
                at = int(torch.searchsorted(p, torch.tensor(row[2], dtype=p.dtype)))
                if at < p.numel() and int(p[at]) == row[2]:
                    raise KVMemError(f"head {h} already holds position {row[2]}")
                insert = lambda t, x, dim=0: torch.cat([t.narrow(dim, 0, at), x, t.narrow(dim, at, t.shape[dim] - at)], dim)  # noqa: E731
                k, v = insert(k, row[0][None].to(k.dtype)), insert(v, row[1][None].to(v.dtype))
                p, w = insert(p, p.new_tensor([row[2]])), insert(w, w.new_tensor([row[3]]))
                a = None if a is None else insert(a, a.new_zeros((a.shape[0], 1)), 1)
            for acc, t in zip(out, (k, v, p, w, a)):
                acc.append(t)
        self._set_rows(*out[:3])
        self.log_weights = out[3]
        if self.head_attention is not None:
            self.head_attention = out[4]
        self.compressed = True

    def kv_tensors(self) -> list[Tensor]:
        if not self.is_initialized:
            return []
        return [self._k, self._v] if self.dense else [*self._k, *self._v]

    def state_tensors(self) -> list[Tensor]:
        if not self.is_initialized:
            return []
        extra = [t for t in (self.recent_queries, self.recent_positions) if t is not None]
        return ([self._p] if self.dense else list(self._p)) + (self.head_attention or []) + (self.log_weights or []) + extra


class KVCache(Cache):
    """A transformers Cache made of `KVLayer`s, one per decoder layer (sliding layers where the model has them)."""

    def __init__(self, config, observe_window: int = 64, track_attention: bool = False, compressor=None):
        """`compressor` (a `kvmem.compress.Compressor`) makes the cache compress itself after the prefill
        and optionally every N decode steps; the observation it needs is switched on."""
        if compressor is not None:
            observe_window = max(observe_window, compressor.method.observe_window, 1)
            track_attention = track_attention or compressor.method.needs_attention
        text = config.get_text_config()
        n_layers = text.num_hidden_layers
        if compressor is not None:
            compressor.n_layers = n_layers  # layer budgets (pyramid) depend on the depth
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * n_layers
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise KVMemError(f"unsupported attention layer types {sorted(unknown)}")
        layers = [
            KVLayer(text.sliding_window if t == "sliding_attention" else None, observe_window, track_attention, i, compressor)
            for i, t in enumerate(layer_types[:n_layers])
        ]
        super().__init__(layers=layers)

    def kv_bytes(self) -> int:
        """Bytes held by key and value tensors (measured from their storages)."""
        return storage_bytes(t for layer in self.layers for t in layer.kv_tensors())

    def state_bytes(self) -> int:
        """Bytes of positions and scorer observations held beside the KV."""
        return storage_bytes(t for layer in self.layers for t in layer.state_tensors())

    def tokens_held(self) -> list[list[int]]:
        """Tokens held per layer and KV head."""
        return [layer.lengths() for layer in self.layers]

    def clone(self) -> "KVCache":
        """An independent copy (tensors copied), e.g. to try several compressions on one prefill."""
        return copy.deepcopy(self)

    def drop_observations(self) -> None:
        """Free scorer state (recent queries, accumulated attention) once no more compression is planned."""
        for layer in self.layers:
            layer.recent_queries = layer.recent_positions = layer.head_attention = None
            layer.observe_window, layer.track_attention = 0, False


def kvmem_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                    scaling: float | None = None, **kwargs):
    """SDPA, with the per-head mask of a compressed kvmem layer when there is one, plus observation
    (or kv-embedding's re-routed prefix in the layers it asks for)."""
    mask = kwargs.pop("kvmem_mask", None)
    heads = kwargs.pop("kvmem_heads", None)  # a layer whose heads hold different numbers of tokens
    layer = kwargs.pop("kvmem_layer", None)
    reroute = kwargs.pop("kvmem_reroute", None)  # kv-embedding's prefix slot (kvmem.embed.kv_embedding)
    scaling = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if reroute is not None and (out := reroute.attend(module, query, key, value, scaling)) is not None:
        return out
    if layer is not None and layer.track_attention:  # the layer computes attention itself, keeping the weights
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported with track_attention")
        return layer.observe(query, scaling), None
    if mask is None and heads is None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    else:
        if kwargs.get("softcap") is not None:
            raise KVMemError("attention logit soft-capping is not supported on compressed kvmem layers")
        if heads is None:
            out = (masked_attention(query, key, value, mask, scaling), None)
        else:
            out = (torch.cat([masked_attention(q, k[None, None], v[None, None], allowed[None, None], scaling)
                              for q, (k, v, allowed) in zip(query.chunk(len(heads), dim=1), heads)], dim=2), None)
    if layer is not None:
        layer.observe(query, scaling)
    return out


def masked_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """SDPA of query heads (B, Hq, Q, D) over KV heads (B, Hkv, T, D) with a per-KV-head bool mask
    (B, Hkv, Q, T). The query heads sharing a KV head are stacked as extra query rows, so keys and values
    are read in place (no repeat per query head). Returns (B, Q, Hq, D)."""
    b, hq, q_len, d = query.shape
    hkv = key.shape[1]
    groups = hq // hkv
    q = query.reshape(b, hkv, groups * q_len, d)
    m = mask[:, :, None].expand(b, hkv, groups, q_len, mask.shape[-1]).reshape(b, hkv, groups * q_len, mask.shape[-1])
    o = F.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)
    return o.reshape(b, hq, q_len, -1).transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION_NAME, kvmem_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def check_supported(model) -> None:
    """Probe the model with 3 tokens: it must be causal (changing the last token leaves the earlier
    logits alone) and every layer must go through kvmem's cache and attention."""
    try:
        with torch.no_grad():
            a = model(input_ids=torch.tensor([[1, 2, 3]], device=model.device)).logits[0, :2]
            b = model(input_ids=torch.tensor([[1, 2, 4]], device=model.device)).logits[0, :2]
        if not torch.allclose(a, b, atol=1e-4):
            raise KVMemError(f"{type(model).__name__} is not causal (a decoder-only LM); kvmem cannot cache it")
        cache = KVCache(model.config, observe_window=1)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]], device=model.device), cache=cache, use_cache=True)
    except KVMemError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means the architecture is not one kvmem can drive
        raise KVMemError(f"{type(model).__name__} is unsupported: a probe forward with a kvmem cache failed "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    missing = [i for i, layer in enumerate(cache.layers) if layer.recent_queries is None]
    if missing:
        raise KVMemError(
            f"{type(model).__name__} does not route attention through kvmem's cache in layers {missing[:5]}; unsupported model"
        )

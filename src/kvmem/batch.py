"""Decode several caches in one batched forward: `BatchedCache` (one prompt, padded) and `RowBatch` (rows that join
and leave, each at its own position; continuous batching).

Decoding on a CPU is bound by reading the weights, so answering B caches together costs little more
than answering one. The benchmark answers one sample with every method and keep ratio at once this
way; a server can decode concurrent requests together the same way.

`BatchedCache` copies the rows of B `KVCache`s (same model, same next position; heads may hold any
tokens) into one padded (B, heads, T, head_dim) buffer. Padding gets a position no query reaches, so
the per-head mask built from positions (causal, sliding window) also hides it. The source caches are
not changed. New tokens are appended at the same positions in every row.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvmem.attention import rows_mask
from kvmem.cache import KVCache
from kvmem.layer import KVLayer
from kvmem.errors import KVMemError

_PAD_POSITION = torch.iinfo(torch.int32).max  # after every query: causally invisible


class BatchedLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False

    def __init__(self, layers: list[KVLayer], spare: int = 64):
        if len({layer.next_position for layer in layers}) != 1:
            raise KVMemError("batched caches must continue at the same position (one prompt, compressed differently)")
        first = layers[0]
        self.is_initialized = True
        self.sliding_window, self.is_sliding = first.sliding_window, first.is_sliding
        self.next_position = first.next_position
        self.dtype, self.device = first.dtype, first.device
        self.n = max(max(layer.lengths()) for layer in layers)
        shape = (len(layers), first.num_heads, self.n + spare)
        # written once each (rows, then zeros in the padding: masked, but 0 * garbage could be NaN)
        self.keys = first.head_keys[0].new_empty((*shape, first.head_keys[0].shape[-1]))
        self.values = first.head_values[0].new_empty((*shape, first.head_values[0].shape[-1]))
        self.positions = torch.full(shape, _PAD_POSITION, dtype=torch.int32, device=self.device)
        # rows standing for several tokens (compensation rows, KVLayer.log_weights): their logit offsets
        self.log_weights = torch.zeros(shape, dtype=self.dtype) if any(layer.log_weights for layer in layers) else None
        for b, layer in enumerate(layers):
            for h, (k, v, p) in enumerate(zip(layer.head_keys, layer.head_values, layer.head_positions)):
                t = k.shape[0]
                self.keys[b, h, :t], self.values[b, h, :t], self.positions[b, h, :t] = k, v, p
                self.keys[b, h, t:], self.values[b, h, t:] = 0, 0
                if layer.log_weights is not None:
                    self.log_weights[b, h, :t] = layer.log_weights[h]

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: dict | None = None, **_) -> tuple[Tensor, Tensor]:
        q = key_states.shape[2]
        position_ids = (kwargs or {}).get("position_ids")
        new_pos = (position_ids.reshape(-1, q)[0] if position_ids is not None else
                   torch.arange(self.next_position, self.next_position + q)).to(device=self.device, dtype=torch.int32)
        if self.n + q > self.keys.shape[2]:  # grow all rows together
            grow = q + 64
            pad = lambda t, fill: torch.cat([t, t.new_full((*t.shape[:2], grow, *t.shape[3:]), fill)], dim=2)  # noqa: E731
            self.keys, self.values = pad(self.keys, 0), pad(self.values, 0)
            self.positions = pad(self.positions, _PAD_POSITION)
            if self.log_weights is not None:
                self.log_weights = pad(self.log_weights, 0)
        self.keys[:, :, self.n:self.n + q] = key_states
        self.values[:, :, self.n:self.n + q] = value_states
        self.positions[:, :, self.n:self.n + q] = new_pos
        self.n += q
        self.next_position = max(self.next_position, int(new_pos.max()) + 1)
        kp, qp = self.positions[:, :, None, :self.n], new_pos[None, None, :, None]
        allowed = kp <= qp
        if self.is_sliding:
            allowed &= (qp - kp) < self.sliding_window
        if self.log_weights is not None:
            allowed = torch.where(allowed, self.log_weights[:, :, None, :self.n], torch.tensor(float("-inf"), dtype=self.dtype))
        if kwargs is not None:
            kwargs["kvmem_mask"] = allowed
        return self.keys[:, :, :self.n], self.values[:, :, :self.n]

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only these batch rows (finished answers leave the batch, so later steps read less)."""
        self.keys, self.values, self.positions = self.keys[rows], self.values[rows], self.positions[rows]
        if self.log_weights is not None:
            self.log_weights = self.log_weights[rows]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise KVMemError("a BatchedCache is built from filled caches")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0  # kvmem's attention uses the mask built in update()

    def get_seq_length(self) -> int:
        return self.next_position

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVMemError("a BatchedCache cannot be reset")

    def reorder_cache(self, beam_idx) -> None:
        raise KVMemError("a BatchedCache does not support beam search")


class BatchedCache(Cache):
    """B caches of one prompt as one batch (see the module doc). `len(cache.rows)` is the batch size."""

    def __init__(self, caches: list[KVCache]):
        if not caches:
            raise KVMemError("nothing to batch: no caches")
        if len({len(c.layers) for c in caches}) != 1:
            raise KVMemError("batched caches must come from the same model")
        if any(getattr(layer.rows, "retrieves", False) for c in caches for layer in c.layers):
            raise KVMemError("an offloaded cache retrieves rows as it attends; it is answered alone, not batched")
        super().__init__(layers=[BatchedLayer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers))])
        self.rows = len(caches)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current batch), in this order."""
        index = torch.tensor(rows, dtype=torch.long)
        for layer in self.layers:
            layer.keep_rows(index)
        self.rows = len(rows)


class RowLayer(CacheLayerMixin):
    """Layer `idx` of every row of a `RowBatch`: each row's own `KVLayer` takes its new keys and values (its storage,
    its method's observation, its quantization) and says what its attention reads; kvmem's attention then runs row
    by row (`kvmem_rows`), so no row is padded to another's length."""

    is_compileable = False
    is_croppable = False

    def __init__(self, batch: "RowBatch", idx: int):
        self.batch, self.idx = batch, idx
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: dict | None = None, **_) -> tuple[Tensor, Tensor]:
        if kwargs is None or kwargs.get("position_ids") is None:
            raise KVMemError("a RowBatch needs position_ids (one row of positions per sequence)")
        position_ids = kwargs["position_ids"]
        q = key_states.shape[2]
        rows = []
        for b, (cache, new_pos) in enumerate(zip(self.batch.caches, self.batch.row_positions(position_ids))):
            layer = cache.layers[self.idx]
            own = {"position_ids": position_ids[b:b + 1], "kvmem_batched": True, "kvmem_new_pos": new_pos}
            k, v = layer.update(key_states[b:b + 1], value_states[b:b + 1], kwargs=own)
            if "kvmem_mask" not in own and "kvmem_heads" not in own and q > 1:
                # an uncompressed layer leaves the mask to the model, which cannot make one per row: build it from
                # the contiguous positions it holds (the same mask, so transformers' SDPA path is unchanged)
                new_pos = position_ids[b].to(torch.int32)
                held = torch.arange(int(new_pos[-1]) + 1 - k.shape[2], int(new_pos[-1]) + 1, dtype=torch.int32)
                own["attention_mask"] = rows_mask(held[None], new_pos, layer.sliding_window)
                if own["attention_mask"] is not None:
                    own["attention_mask"] = own["attention_mask"][None]
            rows.append((k, v, own))
        kwargs["kvmem_rows"] = rows
        return key_states, value_states  # unread: kvmem_rows is used

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise KVMemError("a RowBatch holds filled caches")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the model's mask is unused: each row brings its own

    def get_seq_length(self) -> int:
        return 0  # rows stand at different positions: the caller passes position_ids

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise KVMemError("a RowBatch cannot be reset; let its rows leave")

    def reorder_cache(self, beam_idx) -> None:
        raise KVMemError("a RowBatch does not support beam search")


class RowBatch(Cache):
    """Sequences decoded together, each in its own `KVCache`: rows join and leave between any two forwards, and each
    keeps its own positions (RoPE per row), length, compression method, quantization and per-head ragged rows.

    Continuous batching needs exactly this: the linear layers (the weights, what a CPU decode step is bound by) run
    once for the whole batch, while attention reads every row's own storage in place, so nothing is copied into a
    padded buffer and no row pays for another's length (`BatchedCache` pads instead: one prompt, fixed rows).

        batch = RowBatch(lm.model.config)
        batch.join(cache_a); batch.join(cache_b)
        logits = kvmem.forward.step(lm, batch, [token_a, token_b])   # one forward, (2, vocab)
        batch.leave(cache_a)
    """

    def __init__(self, config, caches: list[KVCache] = ()):
        text = config.get_text_config()
        self.n_layers = text.num_hidden_layers
        super().__init__(layers=[RowLayer(self, i) for i in range(self.n_layers)])
        self.caches: list[KVCache] = []
        self._positions: tuple[Tensor, list] | None = None  # `row_positions` of the forward under way
        for cache in caches:
            self.join(cache)

    def join(self, cache: KVCache) -> None:
        if not isinstance(cache, KVCache) or len(cache.layers) != self.n_layers:
            raise KVMemError(f"only a kvmem KVCache of this model ({self.n_layers} layers) can join the batch")
        if any(c is cache for c in self.caches):
            raise KVMemError("this cache is already a row of the batch")
        if not cache.layers[0].is_initialized:
            raise KVMemError("an empty cache cannot join the batch: prefill it first")
        self.caches.append(cache)

    def leave(self, cache: KVCache) -> None:
        for i, c in enumerate(self.caches):
            if c is cache:
                del self.caches[i]
                return
        raise KVMemError("this cache is not a row of the batch")

    def __len__(self) -> int:
        return len(self.caches)

    def next_positions(self) -> list[int]:
        return [c.get_seq_length() for c in self.caches]

    def row_positions(self, position_ids: Tensor) -> list[tuple[Tensor, int, int]]:
        """Per row, its new tokens' positions as int32 and the first and largest of them: made once a forward (every
        layer gets the same `position_ids`), where each of the rows' layers converting them cost a decode step ~2 %."""
        if self._positions is None or self._positions[0] is not position_ids:
            rows = position_ids.to(torch.int32)
            self._positions = (position_ids, [(r, int(r[0]), int(r.max())) for r in rows])
        return self._positions[1]

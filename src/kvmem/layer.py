"""One attention layer of a `KVCache` (`cache.py` states the contract): transformers' layer interface over per-head
row storage (`rows.py`), the observation the scorers read (`observe.py`), and the compressor that evicts rows after
attention; a quantized layer's rows are a scheme's (`quant/base.py`)."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from kvmem.attention import rows_mask, sees_all, visible
from kvmem.errors import KVMemError
from kvmem.observe import Observation
from kvmem.quant.base import QuantizedRows, Scheme
from kvmem.rows import DenseRows, ExportedRows, Rows, empty_rows, import_rows


class KVLayer(CacheLayerMixin):
    """One attention layer's cache: transformers' layer interface over per-head row storage (`rows.py`),
    the observation the scorers read (`observe.py`), and the compressor that evicts rows after attention."""

    is_compileable = False
    is_croppable = False

    def __init__(self, sliding_window: int | None = None, observe_window: int = 64, track_attention: bool = False,
                 layer_idx: int = 0, compressor=None, quant: Scheme | None = None, attention_decay: float = 1.0):
        self.is_initialized = False
        self.quant = quant  # rows held quantized by this scheme (kvmem.quant), or None: the model's dtype
        self.layer_idx = layer_idx
        self.compressor = compressor  # called after each forward's attention (see compress.Compressor)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.observation = Observation(observe_window, track_attention, attention_decay)
        # True once the rows are no longer what transformers' own layer would hold (evicted, or a quantized
        # sliding layer keeping a partly expired block), so kvmem builds the mask from positions
        self.compressed = False
        self.next_position = 0
        self.rows: Rows | None = None
        # Per head (T_h,): log of how many tokens a row stands for, added to its attention logit. None: every row
        # is one token. RazorAttention's compensation rows (the mean of n dropped tokens) carry log(n).
        self.log_weights: list[Tensor] | None = None
        # What the current forward's attention sees: per head keys, values, positions, and the new tokens'
        # positions; set by update(), read by observe() and the compressor it calls, then released.
        self.seen: tuple | None = None
        # Set while a loader thread is still putting this layer's stored rows in place (`reuse/pipeline.py`): called
        # first by every method the model's forward calls on the layer, it waits until they are there.
        self.arrival = None

    # -- what is held ----------------------------------------------------------------------------------
    @property
    def dense(self) -> bool:
        return isinstance(self.rows, DenseRows)

    @property
    def num_heads(self) -> int:
        return self.rows.num_heads

    def lengths(self) -> list[int]:
        return self.rows.lengths() if self.rows is not None else []

    @property
    def head_keys(self) -> list[Tensor]:
        return [k for k, _, _ in self.rows.heads()]

    @property
    def head_values(self) -> list[Tensor]:
        return [v for _, v, _ in self.rows.heads()]

    @property
    def head_positions(self) -> list[Tensor]:
        return self.rows.positions()

    def visible_range(self, next_position: int | None = None) -> range:
        """The positions an uncompressed layer holds for the next token: all, or a sliding layer's last window - 1."""
        end = self.next_position if next_position is None else next_position
        return range(max(end - self.sliding_window + 1, 0) if self.is_sliding else 0, end)

    def evicted(self) -> bool:
        """Whether some head lacks a token the next one could see (eviction; not quantization)."""
        want = self.visible_range()
        return any(p.numel() < len(want) or (len(want) and not bool((p[-len(want):] == torch.arange(want.start, want.stop)).all()))
                   for p in self.head_positions)

    def kv_tensors(self) -> list[Tensor]:
        return self.rows.kv_tensors() if self.is_initialized else []

    def state_tensors(self) -> list[Tensor]:
        if not self.is_initialized:
            return []
        return self.rows.position_tensors() + (self.log_weights or []) + self.observation.tensors()

    def export_rows(self) -> ExportedRows:
        """This layer's rows (per head keys, values, positions, and row log-weights when some rows stand for
        several tokens), copied: for the chunk store."""
        out = self.rows.export_rows()
        for head, w in zip(out.heads, self.log_weights or []):
            head["log_weights"] = w.clone()
        return out

    def import_rows(self, rows: ExportedRows, next_position: int | None = None, spare: int = 0,
                    adopt: bool = False) -> None:
        """Replace what this layer holds with `rows` (checked against the layer). Decoding continues at
        `next_position` (default: after the last row). Observation starts afresh. Rows exported encoded (a
        quantized layer's `export_rows`) come back exactly as they were, into a layer of the same scheme.
        `spare`: free rows for tokens about to follow, `adopt`: take the rows' buffers as they are (`rows.store_rows`)."""
        encoded = rows.codec != "raw"
        if encoded:
            if self.quant is None:
                raise KVMemError(f"rows are encoded as {rows.codec!r}; this layer holds raw rows (make the cache with "
                                 f"quant='{rows.codec}')")
            if self.is_initialized and len(rows.heads) != self.num_heads:
                raise KVMemError(f"rows for {len(rows.heads)} KV heads; this layer has {self.num_heads}")
            dim = rows.heads[0]["residual_keys"].shape[-1] if rows.heads and "residual_keys" in rows.heads[0] else None
            if self.is_initialized and self.num_heads and dim != self.head_keys[0].shape[-1]:
                raise KVMemError(f"encoded rows of head_dim {dim}; this layer's head_dim is {self.head_keys[0].shape[-1]}")
            stored = QuantizedRows.import_encoded(self.quant, rows)
            self.dtype, self.device = stored.dtype, rows.heads[0]["positions"].device
            self.is_initialized = True
        elif self.is_initialized:
            stored = import_rows(rows, self.num_heads, self.head_keys[0].shape[-1] if self.num_heads else None, self.dtype,
                                 spare, adopt)
        else:
            stored = import_rows(rows, spare=spare, adopt=adopt)
            self.dtype, self.device = rows.heads[0]["keys"].dtype, rows.heads[0]["keys"].device
            self.is_initialized = True
        weights = [h.get("log_weights") for h in rows.heads]
        if any(w is not None for w in weights):
            if any(w is None or w.shape != h["positions"].shape for w, h in zip(weights, rows.heads)):
                raise KVMemError("rows carry log-weights for some heads or rows only")
        last = max((int(h["positions"][-1]) for h in rows.heads if h["positions"].numel()), default=-1)
        next_position = last + 1 if next_position is None else next_position
        if next_position <= last:
            raise KVMemError(f"next position {next_position} is not after the last row (position {last})")
        self.rows, self.next_position = stored, next_position
        self.log_weights = [w.clone() for w in weights] if weights[0] is not None else None
        want = self.visible_range(next_position)  # exactly what an uncompressed layer would hold
        contiguous = all(p.numel() == len(want) and bool((p == torch.arange(want.start, want.stop)).all())
                         for p in self.head_positions)
        self.compressed = not contiguous or self.log_weights is not None
        self.observation = Observation(self.observation.window, self.observation.track_attention,
                                       self.observation.decay)
        if self.quant is not None and not encoded:
            self.quantize(self.quant)

    def quantize(self, scheme: Scheme) -> None:
        """Hold this layer's rows encoded by `scheme` (a layer's view, `Scheme.for_layer`) from now on: the rows held
        now are encoded in blocks (the rest stays in the full-precision residual), and so are later ones."""
        self.quant = scheme
        if self.is_initialized:
            self.rows = scheme.rows_of(self.head_keys, self.head_values, self.head_positions)
            if hasattr(self.rows, "see_queries") and self.observation.recent_queries is not None:
                self.rows.see_queries(self.observation.recent_queries)  # those observed stand in for the prefill's
                self.rows.flush()

    # -- transformers' layer interface -------------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        shape = (key_states.shape[1], key_states.shape[-1], self.dtype, self.device, value_states.shape[-1])
        self.rows = self.quant.new_rows(*shape) if self.quant else empty_rows(*shape)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: dict | None = None, **_) -> tuple[Tensor, Tensor]:
        if self.arrival is not None:
            self.arrival()
        if key_states.shape[0] != 1:
            raise KVMemError(f"a kvmem cache holds one sequence; got batch size {key_states.shape[0]}")
        if kwargs is None:
            raise KVMemError("this model does not pass its attention kwargs to the cache; kvmem cannot drive it")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[2]
        position_ids = kwargs.get("position_ids")
        if "kvmem_new_pos" in kwargs:  # a RowBatch's row: its positions as int32 and their ends, made once a forward
            new_pos, first, last = kwargs["kvmem_new_pos"]
        else:
            if position_ids is not None:
                new_pos = position_ids.reshape(-1)[-n_new:].to(device=self.device, dtype=torch.int32)
            else:
                new_pos = torch.arange(self.next_position, self.next_position + n_new, dtype=torch.int32, device=self.device)
            first, last = int(new_pos[0]), int(new_pos.max())
        if first != self.next_position:
            self.compressed = True
        self.rows.append(key_states[0], value_states[0], new_pos)
        self.observation.appended(n_new)
        if self.log_weights is not None:  # new tokens are one token each
            self.log_weights = [torch.cat([w, w.new_zeros(n_new)]) for w in self.log_weights]
        self.next_position = max(self.next_position, last + 1)
        # What attention sees, taken before a sliding layer drops what later tokens cannot see.
        if getattr(self.rows, "retrieves", False):  # offloaded rows (compress/offload/): they retrieve, then attend
            kwargs["kvmem_offload"] = (self.rows, new_pos)
            return key_states, value_states  # unread: the rows' `attend` reads its working set
        if self._decodes_in_place(new_pos, kwargs.get("kvmem_batched", False)):  # codes read where they are, not decoded
            kwargs["kvmem_decode"] = self.rows
            keys, values, heads = key_states, value_states, None  # unread: attend_in_place reads the rows
        elif (stacked := self.rows.stacked()) is not None:  # every head equally long: (H, T, D), a view of dense storage
            keys, values, positions = stacked
            heads = list(zip(keys, values, positions))
            if self.compressed:
                lw = torch.stack(self.log_weights) if self.log_weights is not None else None
                mask = rows_mask(positions, new_pos, self.sliding_window, lw, self.dtype)
                kwargs["kvmem_mask"] = None if mask is None else mask[None]
            elif self.quant is not None and sees_all(positions, new_pos, self.sliding_window):
                # a quantized layer's decode step: its decoded rows are a fresh copy (no bit-identity with
                # transformers' path to keep), so kvmem's attention reads them without repeat_kv's GQA copy
                kwargs["kvmem_mask"] = None
            keys, values = keys[None], values[None]
        elif (flat := self._flat_rows(new_pos)) is not None:  # quantized heads of different lengths, decoded at once
            keys, values, kwargs["kvmem_flat"] = flat
            heads = None
        else:  # heads of different lengths: attention runs per KV head on its exact rows (nothing padded)
            heads = self.rows.heads()
            lws = self.log_weights or [None] * len(heads)
            kwargs["kvmem_heads"] = [(k, v, _first(rows_mask(p[None], new_pos, self.sliding_window,
                                                            None if w is None else w[None], self.dtype)))
                                     for (k, v, p), w in zip(heads, lws)]
            keys, values = heads[0][0][None, None], heads[0][1][None, None]  # unread: kvmem_heads is used
        if self.is_sliding:
            self._trim_to_window()
        if self.observation.active or self.compressor is not None or self.quant is not None:
            kwargs["kvmem_layer"] = self
            self.seen = (*(map(list, zip(*heads)) if heads is not None else (None,) * 3), new_pos)
        return keys, values

    def _decodes_in_place(self, new_pos: Tensor, batched: bool = False) -> bool:
        """Whether this forward's attention reads the rows in place with the decode kernel (`attention.attend_in_place`):
        one new token that sees every row, nothing that needs the rows per head (tracked attention, a compressor, row
        log-weights), and either quantized rows of a scheme with a kernel or float32 rows of an evicted layer or of a
        row of a `RowBatch` (`batched`). A sequence decoded alone keeps transformers' SDPA on its uncompressed layers:
        bit-identical to an uncompressed cache. In a batch, one kernel call for every row replaces an SDPA call per
        row and layer, each copying its keys and values per query head (repeat_kv): measured 128 of 344 ms a step at
        16 rows of 1k tokens."""
        if new_pos.numel() != 1 or self.log_weights is not None or self.compressor is not None \
                or self.observation.track_attention:
            return False
        if self.quant is not None:
            if not getattr(self.rows, "decodes_in_place", lambda: False)():
                return False
        elif not (self.compressed or batched) or self.dtype != torch.float32 or not _kernel_reads(self.rows.kv_tensors()):
            return False
        return not self.is_sliding or all(sees_all(p[None], new_pos, self.sliding_window) for p in self.rows.positions())

    def _flat_rows(self, new_pos: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """A quantized layer whose heads hold different numbers of rows, every head decoded in one pass onto one row
        axis (`QuantizedRows.flat`): keys and values (1, 1, N, D) and which rows each KV head's queries may see
        (H, Q, N). None where the rows are not quantized or cannot be joined, where the scorers need the rows per
        head (tracked attention, a compressor, row log-weights), or for several new tokens: then attention runs head by
        head."""
        # (full-precision ragged rows stay head by head here, in forwards the kernel does not take: copying them onto one
        # axis every step measured 1.2x slower)
        if self.quant is None or self.log_weights is not None or self.compressor is not None \
                or self.observation.track_attention or not hasattr(self.rows, "flat"):
            return None
        if new_pos.numel() > 1:  # several queries: each query head reading every head's rows costs more than it saves
            return None  # (a 21-token question over kvzip@0.5+kivi-8 at 4k: 224 ms flat, 170 ms head by head)
        flat = self.rows.flat()
        if flat is None:
            return None
        keys, values, positions, heads = flat
        allowed = (heads[None, :] == torch.arange(self.num_heads, dtype=heads.dtype)[:, None])[:, None, :]
        if not sees_all(positions[None], new_pos, self.sliding_window):
            allowed = allowed & visible(positions[None], new_pos, self.sliding_window)
        return keys[None, None], values[None, None], allowed

    def _trim_to_window(self) -> None:
        """A sliding layer keeps what the next token can still see: positions > next - window (transformers
        keeps the last window-1 tokens; the same set while uncompressed). Copied so dropped rows are freed."""
        cutoff = self.next_position - self.sliding_window
        drop = [int((p <= cutoff).sum()) for p in self.head_positions]  # positions increase: a prefix
        if not any(drop):
            return
        if self.quant is None:
            self._keep([torch.arange(d, n) for d, n in zip(drop, self.lengths())])
            return
        before = self.lengths()
        self.rows.drop_prefix(drop)  # whole encoded blocks only: nothing is re-encoded
        if any(int(p[0]) <= cutoff for p in self.head_positions if p.numel()):
            self.compressed = True  # expired rows stay: the mask from positions hides them
        kept = [torch.arange(b - a, b) for b, a in zip(before, self.lengths())]
        self.observation.kept(kept)
        if self.log_weights is not None:
            self.log_weights = [w.index_select(0, i) for w, i in zip(self.log_weights, kept)]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.arrival is not None:
            self.arrival()
        if self.compressed:  # kvmem builds this layer's mask itself; transformers' one is unused
            return max(self.lengths() or [0]) + query_length, 0
        if self.is_sliding:  # mirror DynamicSlidingWindowLayer exactly
            kv_offset = max(self.next_position - self.sliding_window + 1, 0)
            return min(self.next_position, self.sliding_window - 1) + query_length, kv_offset
        return self.next_position + query_length, 0

    def get_seq_length(self) -> int:
        if self.arrival is not None:
            self.arrival()
        return self.next_position

    def get_max_length(self) -> int:
        return self.sliding_window or -1

    def reset(self) -> None:
        self.__init__(self.sliding_window, self.observation.window, self.observation.track_attention, self.layer_idx,
                      self.compressor, self.quant, self.observation.decay)

    def reorder_cache(self, beam_idx) -> None:
        raise KVMemError("kvmem caches hold one sequence; beam search is not supported")

    # -- observation, called by kvmem's attention ----------------------------------------------------
    def observe(self, query: Tensor, scaling: float) -> Tensor | None:
        """After attention: record this forward's queries for the scorers, run the compressor, encode what
        quantized rows have filled; with `track_attention` compute the attention here (returning its output,
        (1, Q, heads, head_dim))."""
        keys, values, positions, new_pos = self.seen
        q = query[0].detach()  # (query heads, new tokens, head_dim)
        self.observation.record(q, new_pos, scaling)
        if hasattr(self.rows, "see_queries"):  # mixed precision (quant/mikv.py) balances keys by the queries' ranges
            self.rows.see_queries(q)
        out = None
        if self.observation.track_attention:
            out = self.observation.attend_and_accumulate(q, scaling, list(zip(keys, values, positions)), new_pos,
                                                         self.sliding_window, self.log_weights, self.lengths())
        if self.compressor is not None:
            self.compressor(self, self.layer_idx)
        if self.quant is not None:  # after the compressor: evict, then quantize what is kept
            self.rows.flush()
        self.seen = None
        return out

    # -- eviction ------------------------------------------------------------------------------------
    def _keep(self, indices: list[Tensor]) -> None:
        self.rows = self.rows.keep(indices)
        self.observation.kept(indices)
        if self.log_weights is not None:
            self.log_weights = [w.index_select(0, i) for w, i in zip(self.log_weights, indices)]

    def keep_only(self, indices: list[Tensor]) -> None:
        """Keep, for each head, the rows at `indices[h]` (sorted, so positions stay increasing). The kept
        rows are copied into exactly-sized storage and the old buffers are released. Rows that demote instead
        (mixed precision, quant/mikv.py) keep the others at low precision: every row stays, in order, so the
        observation, the log-weights and the mask need no change."""
        indices = [i.sort().values.to(self.device) for i in indices]
        if hasattr(self.rows, "demote"):
            self.rows.demote(indices)
            return
        self._keep(indices)
        self.compressed = True

    def refit_rows(self, values: list[Tensor | None], log_weights: list[Tensor | None]) -> None:
        """Replace, per head, the values of every row held and set the rows' log-weights (None: that head is left
        as it is): for methods that rebuild the kept rows after eviction (compress/attention_matching.py). Keys and
        positions stay, so the observation stays aligned."""
        if self.quant is not None or hasattr(self.rows, "demote"):
            raise KVMemError("refit rows need full-precision rows; this layer's rows are quantized or mixed precision")
        heads = self.rows.heads()
        weights = self.log_weights or [torch.zeros(n, dtype=self.dtype, device=self.device) for n in self.lengths()]
        new_values, new_weights = [], []
        for h, ((_, v, p), w, nv, nw) in enumerate(zip(heads, weights, values, log_weights)):
            if (nv is None) != (nw is None) or (nv is not None and (nv.shape != v.shape or nw.shape != p.shape)):
                raise KVMemError(f"head {h}: refit values and log-weights must both be given, shaped like its rows")
            new_values.append(v if nv is None else nv.to(v.dtype))
            new_weights.append(w if nw is None else nw.to(w.dtype))
        self.rows = self.rows.with_rows([k for k, _, _ in heads], new_values, [p for _, _, p in heads])
        self.log_weights = new_weights
        self.compressed = True

    def add_rows(self, rows: list[tuple[Tensor, Tensor, int, float] | None]) -> None:
        """Insert one row per head (key, value, position, log-weight), or nothing where None, in position order.
        The position must be one the head does not hold (e.g. a dropped token's); it has received no attention.
        Rows that demote instead of dropping (quant/mikv.py) still hold every token a compensation row would
        stand for, so none is added (it would count them twice)."""
        if hasattr(self.rows, "demote"):
            return
        weights = self.log_weights or [torch.zeros(n, dtype=self.dtype, device=self.device) for n in self.lengths()]
        out: tuple[list, ...] = ([], [], [], [])
        at_index: list[int | None] = []
        for h, ((k, v, p), w, row) in enumerate(zip(self.rows.heads(), weights, rows)):
            at = None
            if row is not None:
                at = int(torch.searchsorted(p, torch.tensor(row[2], dtype=p.dtype)))
                if at < p.numel() and int(p[at]) == row[2]:
                    raise KVMemError(f"head {h} already holds position {row[2]}")
                insert = lambda t, x: torch.cat([t[:at], x, t[at:]])  # noqa: E731
                k, v = insert(k, row[0][None].to(k.dtype)), insert(v, row[1][None].to(v.dtype))
                p, w = insert(p, p.new_tensor([row[2]])), insert(w, w.new_tensor([row[3]]))
            at_index.append(at)
            for acc, t in zip(out, (k, v, p, w)):
                acc.append(t)
        self.rows = self.rows.with_rows(*out[:3])
        self.log_weights = out[3]
        self.observation.inserted(at_index)
        self.compressed = True


def _kernel_reads(kv: list[Tensor]) -> bool:
    """Whether the decode kernel reads full-precision rows of these keys and values (head_dim a multiple of 8, keys
    as wide as values)."""
    from kvmem import kernel

    return kv[0].shape[-1] % 8 == 0 and kv[0].shape[-1] == kv[-1].shape[-1] and kernel.available()


def _first(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else mask[0]

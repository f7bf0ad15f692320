"""The shared mechanism of the offload-and-retrieve methods: one `OffloadMethod` base, one small file per policy.

Eviction loses what it drops. These methods keep the whole context in a slower tier (`rows.Tier`: packed rows) and
hold a small working set resident (`rows.OffloadedRows`); every forward (or, for LouisKV, every forward whose query
has moved) the policy retrieves, with the queries in hand, the rows it needs into the resident buffer. A policy says
two things: `build_index` (at offload time: its retrieval units and what it keeps to score them) and `retrieve` (per
forward: which tier rows each KV head should hold, or None to keep the current ones); it may also correct the
attention output for the rows left in the tier (`interpolate`, SparQ's mean value).

Keep ratio = the resident fraction: per layer, the resident bytes (sink + recent rows, the resident index, the
retrieved rows' buffer) are at most `keep_ratio` of the context rows' bytes in the model's dtype, the same bytes an
eviction method keeps at that ratio; rows appended afterwards (question, answer) are resident on top, as they are for
eviction. Sliding-window layers are left as they are (their window bounds them; what is offloaded is the global
layers: Gemma-3's 1 in 6), as `sliding=keep` does for eviction.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from kvmem.compress.base import Method, ModelContext
from kvmem.compress.evict import CompressionResult
from kvmem.compress.offload.rows import TIERS, OffloadedRows, offload_layer
from kvmem.errors import KVMemError


class OffloadMethod(Method):
    """Base of an offload-and-retrieve policy. Options every policy takes: `sink` and `recent` (context rows always
    resident, full precision), `tier` (the offloaded rows' precision, `rows.TIERS`)."""

    offloads: ClassVar[bool] = True  # compress() offloads instead of evicting
    needs_ids: ClassVar[bool] = False  # builds its units from the token ids (SentenceKV's sentences)
    budgets: ClassVar[tuple[str, ...]] = ()  # the retrieval fills the buffer; no allocator
    sliding = "keep"

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8"):
        if sink < 0 or recent < 0:
            raise KVMemError(f"{self.name}: sink and recent must be >= 0 (got sink={sink}, recent={recent})")
        if tier not in TIERS:
            raise KVMemError(f"{self.name}: unknown tier {tier!r}; choose from {', '.join(TIERS)}")
        self.sink, self.recent, self.tier = sink, recent, tier

    # -- what a policy implements ------------------------------------------------------------------------
    def build_index(self, keys: Tensor, positions: Tensor, ids: list[int] | None, layer) -> dict:
        """The offloaded rows' keys (H, T, D) and positions (H, T): the policy's units and summaries. Returns a dict
        with `resident` (tensors held beside the working set, counted in its bytes), `offline` (held in the tier),
        `state` (int bookkeeping, counted as state bytes) and whatever else `retrieve` reads."""
        raise NotImplementedError

    def retrieve(self, rows: OffloadedRows, queries: list[Tensor], scaling: float) -> list[Tensor] | None:
        """Per KV head the tier rows to hold for this forward (at most `rows.capacity`), from the queries of its
        query group, (group, Q, D) each; None keeps the rows held."""
        raise NotImplementedError

    def interpolate(self, rows: OffloadedRows, head: int, query: Tensor, out: Tensor, new_pos: Tensor,
                    scaling: float) -> Tensor:
        """KV head `head`'s attention output (1, Q, group, D) over its resident rows, corrected for the rows left in
        the tier (SparQ's mean-value step); by default as it is."""
        return out

    # -- the mechanism --------------------------------------------------------------------------------------
    def offload(self, cache, ratios: list[float], context: ModelContext | None,
                protect_from: int | None = None) -> CompressionResult:
        """Offload every global layer whose ratio is below 1 (rows at positions >= `protect_from`, the question in the
        query-aware setting, stay resident and outside the budget)."""
        if self.sliding != "keep":
            raise KVMemError(f"{self.name} leaves sliding-window layers as they are (their window bounds them); "
                             "sliding=compress is not supported")
        if self.needs_ids and context is None:
            raise KVMemError(f"{self.name} builds its units from the token ids: pass context=ModelContext(lm, ids)")
        before = cache.kv_bytes(), sum(map(sum, cache.tokens_held()))
        for i, (layer, ratio) in enumerate(zip(cache.layers, ratios)):
            if ratio >= 1.0 or layer.is_sliding or not layer.is_initialized:
                continue
            offloaded = offload_layer(layer, self, ratio, None if context is None else list(context.ids), protect_from)
            if offloaded is None:  # a short context: every row is a sink or recent row, resident anyway
                continue
            layer.rows = offloaded
            layer.compressed = True
            layer.observation.stop()  # its rows are no longer the ones a scorer observed
        return CompressionResult(before[0], cache.kv_bytes(), before[1], sum(map(sum, cache.tokens_held())))


# -- helpers the policies share ----------------------------------------------------------------------------
def fill(order: Tensor, sizes: Tensor, capacity: int) -> Tensor:
    """The units taken, best first (`order`), while their rows fit in `capacity` (a unit that does not fit is skipped,
    smaller later ones may still fit)."""
    taken, used = [], 0
    for u in order.tolist():
        s = int(sizes[u])
        if used + s <= capacity:
            taken.append(u)
            used += s
            if used == capacity:
                break
    return torch.tensor(taken, dtype=torch.long)


def span_rows(starts: Tensor, ends: Tensor, units: Tensor) -> Tensor:
    """The rows of spans `units` ([starts[u], ends[u]) each)."""
    if not units.numel():
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(int(starts[u]), int(ends[u])) for u in units.tolist()])


def span_means(keys: Tensor, starts: Tensor, ends: Tensor) -> Tensor:
    """Mean key of each span, per head: (H, U, D) from keys (H, T, D)."""
    sums = torch.cat([keys.new_zeros((keys.shape[0], 1, keys.shape[-1])), keys.float().cumsum(1)], 1)
    lengths = (ends - starts).to(torch.float32)[None, :, None]
    return ((sums[:, ends] - sums[:, starts]) / lengths).to(keys.dtype)


def fixed_spans(n: int, size: int) -> tuple[Tensor, Tensor]:
    starts = torch.arange(0, n, size)
    return starts, (starts + size).clamp_max(n)

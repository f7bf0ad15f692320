"""`mikv`: MiKV, a mixed-precision KV cache: the tokens eviction would drop are kept, at low precision.

Yang et al. 2024, "No Token Left Behind: Reliable KV Cache Compression via Importance-Aware Mixed Precision
Quantization" (arXiv 2402.18096; abstract in shared/seeds). Dropping the KV pairs an eviction policy deems
unimportant loses context (hallucinations, missed details); keeping them even at 2-3 bits recovers most of
it, while the important pairs need a higher precision. Any kvmem eviction method decides which rows are
important (`compress(cache, get_method("snapkv"), 0.25)`, a `Compressor`, every budget): in a `mikv` cache
`KVLayer.keep_only` *demotes* the other rows to the low-precision store instead of dropping them, so every
head keeps every position (in position order: observation, log-weights and the model's own mask stay valid).
Without an eviction method every row is held at high precision.

Settings, as the paper describes them (its sections 3.1-3.2, read through a public summary; the full text
was not available here, the abstract is):

- Importance from an eviction policy (the paper uses H2O: heavy hitters + recent tokens; here any method).
- Per-token asymmetric round-to-nearest quantization for keys and values at both precisions: min-max scale
  and zero-point per group of `group` channels of one token. Each row is encoded on its own, so moving a row
  between the stores re-encodes only that row, and a sliding layer drops expired rows exactly.
- Outlier balancing of keys (the paper's "balancer"): keys have a few outlier channels, which widen every
  token's range at low bits. Per KV head and channel, b = sqrt(max|q| / max|k|) over the first forward (the
  prefill; max|q| over the query heads sharing the KV head); keys are stored as k * b and decoded as
  dequant(k * b) / b, so q . k = (q / b) . (k * b): the logits see quantization errors in a space where the
  balanced queries and keys have equal ranges. Applied at both precisions (`balance=false` switches it off).
- Precisions: the evicted rows at INT2-INT4, the important ones at INT8 or FP16. Defaults `low=2` (1-4) and
  `high=8`; `high=16` keeps important rows in the model's dtype, 4 and 3 are allowed too.

Deviations and choices:

- Group size: not confirmed from the paper; groups of 32 channels, as kvmem's KIVI (so scales and zero-points
  cost as much), `group=` to change it.
- The balancer is fixed when the first rows are encoded (after the prefill) and reused for later tokens; rows
  quantized after a full-precision prefill (`KVCache.quantize`) take it from the queries the layer observed
  (its recent window).
- No full-precision residual (per-token groups need none): the tokens of a forward are attended at full
  precision by that forward, then encoded at high precision.
- A demoted row stays low (its precision cannot come back) even if a later compression selects it.
- RazorAttention's compensation rows (`budget=razor`) stand for dropped tokens; a mikv layer drops none, so
  it adds none (the razor head split still decides what stays high).
- `Compressor(..., every=N)`: the later recompressions see every row still held, so they demote only about
  N rows per N steps, mostly rows already low: the high set grows with the decoded tokens, as with every=0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.errors import KVMemError
from kvmem.quant.base import Scheme
from kvmem.quant.pack import Quantized, dequantize, quantize
from kvmem.rows import ExportedRows, Rows
from kvmem.spec import format_spec

FULL = 16  # high=16: important rows held in the model's dtype
HIGH_BITS, LOW_BITS = (16, 8, 4, 3), (4, 3, 2, 1)
BALANCE_RANGE = 1e-4  # max|q| / max|k| clamped to [1e-4, 1e4] (a channel that is ~0 in queries or keys)

Store = Quantized | Tensor  # one store's keys or values of one head: codes, or raw rows (high=16)


class MiKV(Scheme):
    name = "mikv"
    demotes = True  # takes the eviction's decision itself: quantize before compressing, not after

    def __init__(self, high: int = 8, low: int = 2, group: int = 32, balance: bool = True):
        if high not in HIGH_BITS or low not in LOW_BITS or low >= high or group < 1:
            raise KVMemError(f"mikv keeps important rows at high = {', '.join(map(str, HIGH_BITS))} bits (16: the model's "
                             f"dtype) and the others at low = {', '.join(map(str, LOW_BITS))} bits, low < high, in "
                             f"groups >= 1; got high={high}, low={low}, group={group}")
        self.high, self.low, self.group, self.balance = high, low, group, balance
        self.bits = float(high)  # before eviction; after it a keep ratio r holds r * high + (1 - r) * low on average
        self.residual = 0

    def check(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise KVMemError(f"{self.spec}: head_dim {head_dim} is not a multiple of the group {self.group} "
                             f"(tokens are quantized in groups of channels); choose e.g. mikv:group={head_dim // 2 or 1}")

    def new_rows(self, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None) -> MixedRows:
        return MixedRows(self, heads, head_dim, dtype, device, value_dim)

    def rows_of(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> MixedRows:
        """These rows, all important: held in full precision until the queries the balancer needs are seen
        (`KVLayer.quantize` passes those it observed; after `import_rows`, the layer's next forward), then
        encoded at high precision."""
        rows = self.new_rows(len(keys), keys[0].shape[-1], keys[0].dtype, keys[0].device, values[0].shape[-1])
        rows.pk, rows.pv, rows.p = [k.clone() for k in keys], [v.clone() for v in values], [p.clone() for p in positions]
        return rows

    @property
    def spec(self) -> str:
        defaults = {"high": 8, "low": 2, "group": 32, "balance": True}
        return format_spec(self.name, {k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v})


def _take(e: Store | None, keep: Tensor) -> Store | None:
    """The rows where `keep` (bool, one per row) is True, exactly (per-token codes: rows are independent)."""
    if e is None or not bool(keep.any()):
        return None
    if isinstance(e, Tensor):
        return e[keep]
    return Quantized(e.packed[keep], e.scale[keep], e.zero[keep], e.bits, e.group, e.dim,
                     (int(keep.sum()), *e.shape[1:]), e.dtype)


def _slice(e: Quantized, start: int, n: int) -> Quantized:
    """Rows start:start + n of per-token codes, in storage of their own."""
    part = slice(start, start + n)
    return Quantized(e.packed[part].clone(), e.scale[part].clone(), e.zero[part].clone(), e.bits, e.group, e.dim,
                     (n, *e.shape[1:]), e.dtype)


def _cat(a: Store | None, b: Store | None) -> Store | None:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, Tensor):
        return torch.cat([a, b])
    return Quantized(torch.cat([a.packed, b.packed]), torch.cat([a.scale, b.scale]), torch.cat([a.zero, b.zero]),
                     a.bits, a.group, a.dim, (a.rows + b.rows, *a.shape[1:]), a.dtype)


def _tensors(e: Store | None) -> list[Tensor]:
    return [] if e is None else [e] if isinstance(e, Tensor) else e.tensors()


class MixedRows(Rows):
    """One layer's rows as two per-token quantized stores per KV head: high precision (important rows) and low
    precision (demoted rows), each in position order, plus the newest rows in full precision until the layer's
    flush. `heads()` decodes both stores and merges them into position order with one gather per head (`low`
    says, per encoded row in position order, which store holds it; `_merge_index` keeps the gather)."""

    def __init__(self, scheme: MiKV, heads: int, head_dim: int, dtype: torch.dtype, device, value_dim: int | None = None):
        self.scheme, self.dtype, self.codec = scheme, dtype, scheme.spec
        empty = lambda d: torch.empty((0, d), dtype=dtype, device=device)  # noqa: E731
        self.hk: list[Store | None] = [None] * heads  # high store, position order
        self.hv: list[Store | None] = [None] * heads
        self.lk: list[Store | None] = [None] * heads  # low store, position order
        self.lv: list[Store | None] = [None] * heads
        self.pk = [empty(head_dim) for _ in range(heads)]  # pending rows, full precision, the newest
        self.pv = [empty(value_dim or head_dim) for _ in range(heads)]
        self.p = [torch.empty(0, dtype=torch.int32, device=device) for _ in range(heads)]  # every row, in order
        self.low = [torch.empty(0, dtype=torch.bool, device=device) for _ in range(heads)]  # per encoded row
        self.balancer: Tensor | None = None  # (heads, head_dim) float32 b, fixed at the first encode
        self.query_max: Tensor | None = None  # (heads, head_dim) max |q| seen before that
        self._order: list[Tensor | None] = [None] * heads  # cached gather (see _merge_index)

    # -- the Rows contract ---------------------------------------------------------------------------
    def lengths(self) -> list[int]:
        return [p.numel() for p in self.p]

    def heads(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        out = []
        for h, p in enumerate(self.p):
            stores = ((self.lk[h], self.lv[h]), (self.hk[h], self.hv[h]))
            parts = [self._decode(h, k, v) for k, v in stores if k is not None]
            if not parts:
                out.append((self.pk[h], self.pv[h], p))
                continue
            k, v = (torch.cat([*t, pending]) for t, pending in zip(zip(*parts), (self.pk[h], self.pv[h])))
            if self.lk[h] is not None and self.hk[h] is not None:  # both stores: one gather into position order
                order = self._merge_index(h)
                k, v = k.index_select(0, order), v.index_select(0, order)
            out.append((k, v, p))
        return out

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        for h in range(len(self.p)):
            self.pk[h] = torch.cat([self.pk[h], keys[h]])
            self.pv[h] = torch.cat([self.pv[h], values[h]])
            self.p[h] = torch.cat([self.p[h], positions])

    def with_rows(self, keys: list[Tensor], values: list[Tensor], positions: list[Tensor]) -> MixedRows:
        """These rows, all at high precision (encoded at the next flush), with this layer's balancer."""
        rows = self.scheme.rows_of(keys, values, positions)
        rows.balancer, rows.query_max = self.balancer, self.query_max
        return rows

    def keep(self, indices: list[Tensor]) -> MixedRows:
        """Exactly the rows at `indices[h]` (increasing), each staying in its store (nothing re-encoded)."""
        out = self.scheme.new_rows(len(self.p), self.pk[0].shape[-1], self.dtype, self.p[0].device, self.pv[0].shape[-1])
        out.balancer, out.query_max = self.balancer, self.query_max
        for h, i in enumerate(indices):
            mask = torch.zeros(self.p[h].numel(), dtype=torch.bool, device=self.p[h].device)
            mask[i] = True
            out._set(h, *self._select(h, mask))
        return out

    def drop_prefix(self, counts: list[int]) -> None:
        """Drop the first `counts[h]` rows of each head (a sliding layer's expired rows), exactly."""
        for h, n in enumerate(counts):
            if n:
                self._set(h, *self._select(h, torch.arange(self.p[h].numel(), device=self.p[h].device) >= n))

    def kv_tensors(self) -> list[Tensor]:
        held = [t for e in (*self.hk, *self.hv, *self.lk, *self.lv) for t in _tensors(e)]
        return held + [*self.pk, *self.pv] + ([self.balancer] if self.balancer is not None else [])

    def position_tensors(self) -> list[Tensor]:
        return [*self.p, *self.low]

    def export_rows(self) -> ExportedRows:
        raise KVMemError(f"rows held as {self.codec} cannot be exported yet (the chunk store's quant codec comes "
                         "with it); decode them with a raw cache instead")

    # -- what the layer calls --------------------------------------------------------------------------
    def see_queries(self, q: Tensor) -> None:
        """A forward's queries (query heads, Q, head_dim), after RoPE: their max |q| per KV head and channel,
        until the balancer is fixed."""
        if self.balancer is not None or not self.scheme.balance or q.shape[1] == 0:
            return
        heads = len(self.p)
        m = q.detach().abs().float().reshape(heads, -1, q.shape[-1]).amax(dim=1)
        self.query_max = m if self.query_max is None else torch.maximum(self.query_max, m)

    def flush(self) -> None:
        """Encode the pending rows at high precision (after each forward's attention and compression)."""
        if not any(k.shape[0] for k in self.pk):
            return
        if self.balancer is None and self.scheme.balance and self.query_max is None:
            return  # imported rows wait, in full precision, for the queries of the layer's next forward
        counts = [k.shape[0] for k in self.pk]
        if len(set(counts)) == 1 and self.scheme.high != FULL:  # decoding: every head's new rows in one encode
            self._fix_balancer()
            k, v = self._encode(None, torch.stack(self.pk), torch.stack(self.pv), self.scheme.high)
            n = counts[0]
            encoded = [(_slice(k, h * n, n), _slice(v, h * n, n)) for h in range(len(counts))]
        else:
            encoded = [self._encode(h, pk, pv, self.scheme.high) if n else None
                       for h, (pk, pv, n) in enumerate(zip(self.pk, self.pv, counts))]
        for h, n in enumerate(counts):
            if not n:
                continue
            k, v = encoded[h]
            self.hk[h], self.hv[h] = _cat(self.hk[h], k), _cat(self.hv[h], v)
            self.low[h] = torch.cat([self.low[h], self.low[h].new_zeros(n)])
            self.pk[h], self.pv[h] = self.pk[h][:0].clone(), self.pv[h][:0].clone()
            # the new rows end the high store, which the decoded rows end: the merge index only grows

    def demote(self, high: list[Tensor]) -> None:
        """Keep the rows at `high[h]` where they are and move every other row of head h to the low-precision
        store: the row count and order do not change. Pending rows are encoded now (demoted ones once, from
        full precision); a row already low stays low."""
        for h, keep in enumerate(high):
            p, low = self.p[h], self.low[h]
            n_enc = low.numel()
            to_low = torch.ones(p.numel(), dtype=torch.bool, device=p.device)
            to_low[keep] = False
            moving = to_low[:n_enc] & ~low  # encoded high rows going low
            pend_low = to_low[n_enc:]
            if not bool(moving.any()) and not self.pk[h].shape[0]:
                continue
            # full-precision (or decoded) rows that become low, in position order: moved high rows, then pending
            moved = moving[~low]  # over the high store's rows
            dk, dv = self._decode(h, _take(self.hk[h], moved), _take(self.hv[h], moved)) if bool(moved.any()) else \
                (self.pk[h][:0], self.pv[h][:0])
            new_k, new_v = torch.cat([dk, self.pk[h][pend_low]]), torch.cat([dv, self.pv[h][pend_low]])
            new_pos = torch.cat([p[:n_enc][moving], p[n_enc:][pend_low]])
            # high store: the high rows that stay, then the kept pending rows (newer than any encoded row)
            hk, hv = _take(self.hk[h], ~moved), _take(self.hv[h], ~moved)
            if bool((~pend_low).any()):
                k, v = self._encode(h, self.pk[h][~pend_low], self.pv[h][~pend_low], self.scheme.high)
                hk, hv = _cat(hk, k), _cat(hv, v)
            # low store: the old low rows and the new ones, merged by position (exact: rows are independent)
            lk, lv = self.lk[h], self.lv[h]
            if new_k.shape[0]:
                k, v = self._encode(h, new_k, new_v, self.scheme.low)
                lk, lv = _cat(lk, k), _cat(lv, v)
                old_pos = p[:n_enc][low]
                if old_pos.numel() and int(old_pos[-1]) > int(new_pos[0]):  # interleaved: sort by position
                    order = torch.cat([old_pos, new_pos]).argsort(stable=True)
                    lk, lv = _permute(lk, order), _permute(lv, order)
            self.hk[h], self.hv[h], self.lk[h], self.lv[h] = hk, hv, lk, lv
            self.low[h] = torch.cat([low | moving, pend_low])
            self.pk[h], self.pv[h] = self.pk[h][:0].clone(), self.pv[h][:0].clone()
            self._order[h] = None

    # -- what it holds, for tests and reports -------------------------------------------------------
    def split(self) -> list[tuple[Tensor, Tensor]]:
        """Per head (positions held at high precision, including pending rows; positions held at low)."""
        out = []
        for p, low in zip(self.p, self.low):
            is_low = torch.cat([low, low.new_zeros(p.numel() - low.numel())])
            out.append((p[~is_low], p[is_low]))
        return out

    # -- internals -------------------------------------------------------------------------------------
    def _fix_balancer(self) -> None:
        """b = sqrt(max|q| / max|k|) per KV head and channel, from the queries seen and the keys held."""
        if self.balancer is not None or not self.scheme.balance:
            return
        key_max = torch.stack([k.detach().abs().float().amax(dim=0) if k.shape[0] else k.new_zeros(k.shape[1]).float()
                               for k, _, _ in self.heads()])
        if self.query_max is None:  # no queries seen (rows demoted right after import): keys as they are
            self.balancer = torch.ones_like(key_max)
            return
        tiny = torch.finfo(torch.float32).tiny
        ratio = self.query_max.clamp_min(tiny) / key_max.clamp_min(tiny)
        self.balancer = ratio.clamp(BALANCE_RANGE, 1 / BALANCE_RANGE).sqrt()
        self.query_max = None

    def _encode(self, h: int | None, keys: Tensor, values: Tensor, bits: int) -> tuple[Store, Store]:
        """Head h's rows (n, D) encoded per token; h None: every head's (heads, n, D), as (heads * n, D)."""
        if bits == FULL:
            return keys.clone(), values.clone()
        self._fix_balancer()
        if self.balancer is not None:
            keys = keys.float() * (self.balancer[h] if h is not None else self.balancer[:, None])
        keys, values = keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1])
        return quantize(keys, bits, self.scheme.group, dim=1), quantize(values, bits, self.scheme.group, dim=1)

    def _decode(self, h: int, keys: Store, values: Store) -> tuple[Tensor, Tensor]:
        if isinstance(keys, Tensor):
            return keys, values
        k = dequantize(keys)
        if self.balancer is not None:
            k = k / self.balancer[h]
        return k.to(self.dtype), dequantize(values).to(self.dtype)

    def _merge_index(self, h: int) -> Tensor:
        """Row i (position order) of head h -> its index in (decoded low store, decoded high store, pending)."""
        order, n = self._order[h], self.p[h].numel()
        if order is None:  # rebuilt after a demotion or selection; pending and newly flushed rows only extend it
            low = self.low[h]
            order = torch.empty(low.numel(), dtype=torch.long, device=low.device)
            n_low = int(low.sum())
            order[low] = torch.arange(n_low, device=low.device)
            order[~low] = torch.arange(n_low, low.numel(), device=low.device)
        if order.numel() < n:
            order = torch.cat([order, torch.arange(order.numel(), n, device=order.device)])
        self._order[h] = order
        return order

    def _select(self, h: int, mask: Tensor) -> tuple:
        """Head h's stores restricted to the rows where `mask` (one per row, position order) is True."""
        low, n_enc = self.low[h], self.low[h].numel()
        enc, pend = mask[:n_enc], mask[n_enc:]
        return (_take(self.hk[h], enc[~low]), _take(self.hv[h], enc[~low]), _take(self.lk[h], enc[low]),
                _take(self.lv[h], enc[low]), self.pk[h][pend], self.pv[h][pend], self.p[h][mask], low[enc])

    def _set(self, h: int, hk, hv, lk, lv, pk, pv, p, low) -> None:
        self.hk[h], self.hv[h], self.lk[h], self.lv[h] = hk, hv, lk, lv
        self.pk[h], self.pv[h], self.p[h], self.low[h] = pk, pv, p, low
        self._order[h] = None


def _permute(e: Store, order: Tensor) -> Store:
    if isinstance(e, Tensor):
        return e.index_select(0, order)
    return Quantized(e.packed.index_select(0, order), e.scale.index_select(0, order), e.zero.index_select(0, order),
                     e.bits, e.group, e.dim, e.shape, e.dtype)

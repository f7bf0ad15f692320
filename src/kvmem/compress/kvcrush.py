"""`kvcrush`: a base method's important tokens, plus representatives of what it drops, grouped by head behaviour.

Jha, Gobriel, Talamanova and Jain 2025, "KVCrush: Key Value Cache size-reduction using similarity in head-behaviour"
(ACML 2025, arXiv 2503.00022; reference code: OpenVINO GenAI, src/cpp/src/continuous_batching/kvcrush.cpp). Each
token is represented by a binary vector with one bit per attention head of the layer: 1 where the head finds it
important. Tokens are ordered by the Hamming distance of their vector to an anchor vector, and representatives
spread evenly over that order fill part of the budget, so the tokens the base method drops are stood for by a few of
each kind; the base method (`base`, a registered method used with its default options) picks the rest.

What kvmem computes, per layer:

* The signal: per query head, the attention each held token gets: from the last `window` observed queries
  (`source=window`, SnapKV's observation window) or accumulated over every query (`source=accumulated`, H2O's;
  needs `track_attention`). The bits span every query head of the layer (all KV groups), as the paper's vectors span
  the layer's heads; a token a KV head no longer holds gets 0 in that head's query heads.
* A bit is 1 where the token is in the top half of the head's held tokens by that signal: the reference's
  `create_indicators_kvcrush` (top num_tokens/2 by score).
* The anchor (`anchor`): `random` (seeded by `seed` and the layer; the reference's default), `mean` (the majority bit
  of each head), `alternate` (0101...), `zeros`, `ones`, as the reference's anchor modes.
* Per KV head, of its budget n_keep: int(`fraction` x n_keep) go to representatives, the rest to the base method's
  own selection (`base.select`, e.g. H2O's recent split). The representatives are taken from the rows the base
  method dropped, sorted by distance (stable, so ties stay in position order), at indices 0, s, 2s, ... with
  s = len // count: the reference's `get_representative_blocks_kvcrush`.

Departures: the reference runs on OpenVINO's paged cache, where a bit stands for a token of a block and a block is
represented, under an absolute KVCrush budget in blocks; kvmem works at token granularity with a per-head vector, as
the paper describes, and states the KVCrush share as a fraction of the keep ratio's budget. The bits are computed
over every row the head holds (protected rows included), where the reference takes the evictable tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext
from kvmem.errors import KVMemError

ANCHORS = ("random", "mean", "alternate", "zeros", "ones")
SOURCES = ("window", "accumulated")


class KVCrush(Method):
    name = "kvcrush"
    methods: dict[str, type[Method]] = {}  # the registry, set by kvmem.compress (which imports this module)

    def __init__(self, base: str = "snapkv", fraction: float = 0.25, anchor: str = "random", source: str = "window",
                 window: int = 32, seed: int = 0):
        # a base that refits rows (attention-matching) or decides its own counts (finch) cannot share a budget
        # (and one that keeps the prompt whole, moment-kv, or sizes its own heads, fastgen, has no share to give)
        usable = [m for m, cls in self.methods.items()
                  if m not in ("full", "kvcrush") and cls.refit is Method.refit and cls.budgets is None
                  and not cls.decode_phase]
        if base not in usable:
            raise KVMemError(f"kvcrush needs base= a method that scores and selects tokens; got base={base!r}; "
                             f"choose from {', '.join(usable)}")
        if not 0 < fraction < 1:
            raise KVMemError(f"kvcrush needs 0 < fraction < 1 (the budget's share of representatives); got fraction={fraction}")
        if anchor not in ANCHORS:
            raise KVMemError(f"kvcrush anchor={anchor!r}: choose from {', '.join(ANCHORS)}")
        if source not in SOURCES:
            raise KVMemError(f"kvcrush source={source!r}: choose {' or '.join(SOURCES)} (the attention the bits read)")
        if window < 1:
            raise KVMemError(f"kvcrush needs window >= 1 observed queries; got window={window}")
        self.base_method = self.methods[base]()  # with its default options
        self.fraction, self.anchor, self.source, self.window, self.seed = fraction, anchor, source, window, seed
        # what the cache must record is the base method's plus what the bits read
        self.needs_model = self.base_method.needs_model
        self.signed_scores = self.base_method.signed_scores  # budget=prefixkv refuses a signed base (get_method)
        self.needs_attention = self.base_method.needs_attention or source == "accumulated"
        self.observe_window = max(self.base_method.observe_window, window if source == "window" else 0)
        self._distance: dict[int, Tensor] = {}

    def score_layer(self, heads: list[HeadView]) -> list[Tensor]:
        self._distance[heads[0].layer] = self.distances(heads)
        return self.base_method.score_layer(heads)

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext | None) -> dict[int, list[Tensor]]:
        for i, heads in views.items():
            self._distance[i] = self.distances(heads)
        return self.base_method.score_cache(views, cache, context)

    def signal(self, head: HeadView) -> Tensor:
        """(group, T): the attention each query head of this KV head's group gives each held row."""
        if self.source == "accumulated":
            return head.attention.float()
        return head.query_attention(last=self.window).sum(dim=1)

    def bits(self, heads: list[HeadView]) -> Tensor:
        """(query heads of the layer, positions) head-behaviour bits: 1 where the row is in the head's top half."""
        size = max(int(h.positions.max()) + 1 for h in heads if h.positions.numel())
        rows = []
        for head in heads:
            s = self.signal(head)
            b = torch.zeros((s.shape[0], size), dtype=torch.bool)
            if s.shape[1]:
                top = s.topk(s.shape[1] // 2, dim=1).indices  # the reference's top num_tokens/2
                b[torch.arange(s.shape[0])[:, None], head.positions[top].long()] = True
            rows.append(b)
        return torch.cat(rows)

    def anchor_bits(self, bits: Tensor, layer: int) -> Tensor:
        n = bits.shape[0]
        if self.anchor == "random":
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + layer)
            return torch.randint(0, 2, (n,), generator=g).bool()
        if self.anchor == "mean":
            return bits.float().mean(dim=1) > 0.5
        if self.anchor == "alternate":
            return torch.arange(n) % 2 == 1
        return torch.full((n,), self.anchor == "ones")

    def distances(self, heads: list[HeadView]) -> Tensor:
        """(positions,) Hamming distance of each position's bits to the layer's anchor."""
        if not any(h.positions.numel() for h in heads):
            return torch.zeros(0, dtype=torch.long)
        bits = self.bits(heads)
        return (bits != self.anchor_bits(bits, heads[0].layer)[:, None]).sum(dim=0)

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        n_rep = int(self.fraction * n_keep)
        chosen = self.base_method.select(head, score, n_keep - n_rep)
        dropped = torch.ones(head.positions.numel(), dtype=torch.bool)
        dropped[chosen] = False
        candidates = dropped.nonzero().flatten()
        n_rep = min(n_rep, candidates.numel())
        if n_rep == 0:
            return chosen
        d = self._distance[head.layer][head.positions[candidates].long()]
        order = candidates[d.sort(stable=True).indices]
        step = order.numel() // n_rep
        return torch.cat([chosen, order[torch.arange(n_rep) * step]])

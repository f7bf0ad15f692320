"""The shared base of token-eviction methods: score -> budget -> evict.

A method sees one KV head at a time (`HeadView`: its keys, values, positions, the recent queries of
its query group, and accumulated attention when tracked) and returns a score per token; higher is
kept. `compress()` (`evict.py`) turns a keep ratio into a per-(layer, head) token budget, asks the method which
tokens to keep, and evicts the rest from the `KVCache` for real.

How many tokens each head keeps is the method's `budget` (an allocator in `budget.py`), set in its spec:
`get_method("snapkv:window=64:budget=adaptive")`. Methods that score by running the model again (KVzip)
set `needs_model` and get a `ModelContext` (the model and the token ids the cache holds).

Compression strength is always stated as the fraction of tokens *kept* (keep ratio in (0, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.layer import KVLayer
from kvmem.observe import Observation
from kvmem.spec import format_spec

if TYPE_CHECKING:
    from kvmem.models import LoadedModel


@dataclass
class HeadView:
    """What a scorer may look at for one KV head of one layer."""

    layer: int
    head: int
    keys: Tensor  # (T, head_dim), after RoPE
    values: Tensor  # (T, head_dim)
    positions: Tensor  # (T,) original positions, increasing
    queries: Tensor  # (group, W, head_dim): the last W queries of the query heads sharing this KV head
    query_positions: Tensor  # (W,)
    attention: Tensor | None  # (group, T) attention accumulated by every query so far, if tracked
    scaling: float
    sliding_window: int | None
    log_weights: Tensor | None = None  # (T,) the rows' log-weights (KVLayer.log_weights), None: one token each

    def query_attention(self, last: int | None = None) -> Tensor:
        """Softmax attention of the last `last` observed queries over this head's keys: (group, last, T)."""
        q = self.queries if last is None else self.queries[:, -last:]
        qp = self.query_positions if last is None else self.query_positions[-last:]
        scores = torch.einsum("gqd,kd->gqk", q, self.keys) * self.scaling
        allowed = self.positions[None, :] <= qp[:, None]
        if self.sliding_window is not None:
            allowed &= (qp[:, None] - self.positions[None, :]) < self.sliding_window
        return scores.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)


@dataclass
class ModelContext:
    """What a method that runs the model needs: the model, the token ids the cache holds (from position 0),
    and how many of them are the chat template's head (`Prompt.head`). `question`: the ids the cache holds after
    `ids`, if any (the question in the query-aware setting, protected from compression; FINCH is guided by it).
    Methods memoize their scores in `memo`, so one context serves every keep ratio tried on copies of one cache;
    make a new one per cache."""

    lm: "LoadedModel"
    ids: list[int]
    head: int = 0
    memo: dict = field(default_factory=dict)
    # set by compress() for the call: the keep ratio of each layer, for methods whose scoring evicts as it goes (finch)
    keep_ratios: list[float] | None = None
    question: list[int] = field(default_factory=list)


def memoized_replay(context: ModelContext | None, cache: KVCache, name: str, key: tuple, compute):
    """`compute(lm, ids)` on the prompt the cache holds, once per `key` per context (one replay serves every keep ratio
    tried on copies of one cache); a missing or mismatched context is refused naming the method."""
    ids = list(context.ids) if context is not None else []
    if not ids or len(ids) > cache.get_seq_length():
        raise KVMemError(f"{name} scores the prompt the cache holds by replaying it: pass context=ModelContext(lm, ids) "
                         "with the ids it holds from position 0")
    memo_key = (name, *key, len(ids))
    if memo_key not in context.memo:
        context.memo[memo_key] = compute(context.lm, ids)
    return context.memo[memo_key]


def keep_recent_and_top(head: HeadView, score: Tensor, n_keep: int, n_recent: int) -> Tensor:
    """Indices of the `n_recent` newest rows (by position) plus the `n_keep - n_recent` best-scoring older ones:
    H2O's heavy hitters + recent window, and Moment-KV's `recent=`."""
    n_recent = min(n_recent, n_keep)
    order = head.positions.argsort()
    recent = order[order.numel() - n_recent:] if n_recent else order[:0]
    older = order[: order.numel() - n_recent]
    return torch.cat([older[score[older].topk(n_keep - n_recent).indices], recent])


SLIDING = ("compress", "keep")  # a method's `sliding` option: what compression does to sliding-window layers


class Method:
    """Base class of an eviction method. Subclasses set `name` and implement `score` (or `select`, or
    `score_cache`). Constructor arguments are the method's options (`name:option=value` in a spec)."""

    name: ClassVar[str]
    needs_attention: ClassVar[bool] = False  # needs KVCache(track_attention=True)
    observe_window: ClassVar[int] = 0  # how many recent queries `score` reads
    needs_model: ClassVar[bool] = False  # scores by running the model: compress() needs `context=`
    signed_scores: ClassVar[bool] = False  # scores may be negative (not a mass): budget=prefixkv refuses the method
    # compresses only the rows generated after the prompt (the cache's first forward, `Observation.prompt_end`); the
    # prompt's rows are always kept (Moment-KV). The keep ratio then applies to the generated rows.
    decode_phase: ClassVar[bool] = False
    decode_budget: int | None = None  # decode-phase methods: a fixed number of generated rows per head instead
    attention_decay: float = 1.0  # the per-step decay tracked attention must have been accumulated with (observe.py)
    # the allocators (budget.py) the method takes: None, every one; a tuple, only those (finch: uniform); (), none: it
    # sizes its heads itself (`counts`: FastGen's policies) and a budget option is refused
    budgets: ClassVar[tuple[str, ...] | None] = None
    budget: str = "uniform"  # the allocator (budget.py); get_method sets it from the spec
    sliding: str = "compress"  # or "keep": sliding-window layers are left whole (SLIDING)
    options: dict = {}  # the spec's options other than budget and sliding, for `spec`

    def evicts_while_decoding(self, keep_ratio: float) -> bool:
        """Whether this is a decode-phase method with generated rows to evict at `keep_ratio` (or its decode budget)."""
        return self.decode_phase and (keep_ratio < 1.0 or self.decode_budget is not None)

    def score(self, head: HeadView) -> Tensor:
        """(T,) importance per token; the highest `n_keep` are kept."""
        raise NotImplementedError

    def score_layer(self, heads: list[HeadView]) -> list[Tensor]:
        """Scores for all heads of a layer; override when heads must share a decision (e.g. TOVA)."""
        return [self.score(h) for h in heads]

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext | None) -> dict[int, list[Tensor]]:
        """Scores of every head of the layers in `views`; override to score from the whole cache (KVzip)."""
        return {layer: self.score_layer(heads) for layer, heads in views.items()}

    def counts(self, scores: dict[int, list[Tensor]], shares: dict[int, list[int]]) -> dict[int, list[int]]:
        """Tokens each head keeps, for methods that size their heads themselves (`budgets = ()`: FastGen's policies);
        `scores` are the compressible tokens' scores per layer and head, `shares` each head's uniform share."""
        raise NotImplementedError

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        """Indices of the tokens to keep. Default: top-`n_keep` by score."""
        return score.topk(n_keep).indices

    def refit(self, head: HeadView, chosen: Tensor, n: int) -> tuple[Tensor, Tensor] | None:
        """After selection, new values (len(chosen), head_dim) and log-weights (len(chosen),) for the kept rows
        `chosen` (sorted indices into the first `n` rows of `head`, the compressible ones; rows from `n` on are
        protected and kept as they are). None (the default): the kept rows stay exactly as they were."""
        return None

    @property
    def spec(self) -> str:
        """The canonical spelling (`name:option=value:...`) used by the CLI and results."""
        extra = {} if self.budget == type(self).budget else {"budget": self.budget}
        if self.sliding != type(self).sliding:
            extra["sliding"] = self.sliding
        return format_spec(self.name, {**self.options, **extra})

    def __repr__(self) -> str:
        return self.spec


def replay(lm: "LoadedModel", cache: KVCache, ids: list[int], on_layer) -> None:
    """Feed `ids` on a copy of `cache` (dropped afterwards) and, in every layer, right after attention, call
    `on_layer(layer_idx, queries, keys, positions, new_positions, scaling)`: the new tokens' queries after
    RoPE (query heads, Q, D), and per KV head the keys and positions attention saw (cached + new, before a
    sliding layer drops what later tokens cannot see). For scorers that run the model (KVzip) and probes."""
    from kvmem.forward import feed

    def hook(layer: KVLayer, idx: int) -> None:
        keys, _, positions, new_pos = layer.seen
        on_layer(idx, layer.observation.recent_queries[:, -len(new_pos):], keys, positions, new_pos,
                 layer.observation.scaling)

    work = cache.clone()
    for layer in work.layers:
        layer.observation = Observation(len(ids))
        layer.compressor = hook
    feed(lm, work, ids)


def causal_logits(queries: Tensor, keys: Tensor, key_pos: Tensor, query_pos: Tensor, scaling: float) -> Tensor:
    """Attention logits (group, Q, K) of one KV head's query group over its keys, -inf where a key comes
    after the query (no sliding window: replays score what a head holds)."""
    logits = (queries.float() * scaling) @ keys.float().T  # scaling the queries costs less than the logits
    return logits.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))

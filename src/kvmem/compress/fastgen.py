"""`fastgen`: one compression policy per KV head, the cheapest whose kept tokens recover the prompt's attention.

Ge et al. 2024, "Model Tells You What to Discard: Adaptive KV Cache Compression for LLMs" (ICLR 2024, arXiv
2310.01801). No official code was released; details the paper leaves open follow the FastGen-style `hybrid`
cache of AnswerDotAI/cold-compress (`KVCacheHybrid.profile_attn_heads` / `build_masks`), as noted below.

**Profiling (the paper's Section 3.3).** The prompt (`context.ids`, from position 0) is run once more on an empty
cache (`replay`) and, per layer and KV head, its attention map A (every prompt query over the keys it sees, causal,
within a sliding window where the layer has one) is measured against the paper's hybrid policies (Eq. 2), each the
union of the one before and one more set:
  C_special (the tokenizer's special tokens: BOS/EOS, chat-template markers such as <|im_start|>),
  + C_punct (tokens whose text is punctuation only: Unicode category P, e.g. ".", ":", "?"),
  + C_frequent (the r_f = 0.3 x n tokens of highest cumulative attention, the sum over every prompt query, among
    those not kept yet; cold-compress takes them the same way),
  + C_local (every key closer than r_l = 0.3 x n to the query: for the profiling, a window per query; in the cache,
    the last 0.3 n tokens),
  C_full (everything).  r_l = r_f = 0.3 are the paper's (Section 5.1), n the prompt's length.
A policy's recovery is the attention mass A puts on the tokens it keeps, averaged over the prompt's queries (the
paper's |A - softmax(QK_C^T)| <= 1 - T read as "recovers a fraction T of A", as in Section 4.1 and cold-compress).
A head takes the first policy whose recovery is >= T.

**From T to kvmem's keep ratio.** The paper's knob is T; kvmem's is the fraction kept. The policies are nested, so
a token entering at policy j is kept exactly when T > the head's recovery at policy j - 1: its score is minus that
recovery (+inf for special tokens, kept by every policy), and one threshold over every head of every compressed
layer is the paper's T. kvmem takes the largest T whose kept tokens fit the keep ratio's total (whole policies
only: a head never keeps part of a policy, so a little of the budget can stay unused), and at most `threshold` if
given (the paper's T, e.g. `fastgen:threshold=0.95`; default 1.0, no cap). `method.profile` reports the T used and
each head's policy. This is why it is a method and not `budget=fastgen`: the policies choose *which* tokens too,
not only how many, so it takes no `budget=` option (refused by name). If the special tokens alone exceed the budget
(a few-token context at a tiny ratio), each head keeps its share of them, the latest first.

Departures: the paper profiles multi-head attention (GQA is left to future work); a kvmem KV head serves a group
of query heads, so its recovery is the mean over the group's queries and its policy is chosen once for the group.
The generation phase (Algorithm 2: each new token is cached only if the head's policy would keep it) is not
reproduced: kvmem compresses the prompt once, and later tokens are appended; compressing again later (`compress`)
treats tokens past the profiled prompt as local ones. Profiling needs the model, so `Compressor` refuses it: prefill,
`compress(..., context=ModelContext(lm, ids))`, then generate. Cost: one more prefill plus the O(n^2) map, memoized
in the context for every keep ratio tried on copies of one cache.
"""

from __future__ import annotations

import math
import unicodedata

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, causal_logits, memoized_replay, replay
from kvmem.errors import KVMemError

POLICIES = ("special", "special+punct", "special+punct+frequent", "special+punct+frequent+local", "full")
BLOCK = 64  # queries per block of the attention map


def special_mask(tokenizer, ids: list[int]) -> Tensor:
    """(len(ids),) True at the tokenizer's special tokens (its special ids and the added tokens marked special)."""
    special = set(tokenizer.all_special_ids)
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return torch.tensor([i in special for i in ids], dtype=torch.bool)


def punct_mask(tokenizer, ids: list[int]) -> Tensor:
    """(len(ids),) True at tokens whose text, stripped of spaces, is one or more punctuation characters."""
    def is_punct(i: int) -> bool:
        text = tokenizer.decode([i]).strip()
        return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)

    verdict = {i: is_punct(i) for i in set(ids)}
    return torch.tensor([verdict[i] for i in ids], dtype=torch.bool)


class FastGen(Method):
    name = "fastgen"
    needs_model = True
    budgets = ()  # its policies size every head (`counts`): get_method refuses a budget option

    def __init__(self, threshold: float = 1.0, local: float = 0.3, frequent: float = 0.3):
        if not 0.0 < threshold <= 1.0:
            raise KVMemError(f"fastgen needs 0 < threshold <= 1 (the attention recovery T); got threshold={threshold}")
        for option, r in (("local", local), ("frequent", frequent)):
            if not 0.0 < r <= 1.0:
                raise KVMemError(f"fastgen needs 0 < {option} <= 1 (a fraction of the prompt); got {option}={r}")
        self.threshold, self.local, self.frequent = float(threshold), float(local), float(frequent)
        self.profile: dict = {}  # after compress: {"threshold": T used, "policies": {layer: [policy per KV head]}}
        self._recovery: dict[int, Tensor] = {}

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        levels, recovery = memoized_replay(context, cache, "fastgen", (self.local, self.frequent), self.profile_prompt)
        out = {}
        self._recovery = {i: recovery[i] for i in views}
        for i, heads in views.items():
            out[i] = []
            for view in heads:
                level = torch.full((view.positions.numel(),), 3, dtype=torch.long)  # past the prompt: local tokens
                inside = view.positions < len(context.ids)
                level[inside] = levels[i][view.head][view.positions[inside].long()]
                out[i].append(level_scores(level, recovery[i][view.head]))
        return out

    def counts(self, scores: dict[int, list[Tensor]], shares: dict[int, list[int]]) -> dict[int, list[int]]:
        """One threshold over every head: the largest T (at most `threshold`) whose policies fit the shares' total."""
        layers = sorted(scores)
        flat = torch.cat([s.double() for layer in layers for s in scores[layer]])
        total = sum(sum(shares[layer]) for layer in layers)
        levels = torch.unique(flat[flat > -self.threshold], sorted=True).flip(0)  # candidate lowest kept scores
        kept = torch.tensor([int((flat >= v).sum()) for v in levels.tolist()])
        fits = (kept <= total).nonzero()
        if not fits.numel():  # the special tokens alone are over budget: each head keeps its share of them
            self.profile = {"threshold": 0.0, "policies": {layer: ["special"] * len(scores[layer]) for layer in layers}}
            return {layer: [min(int((s >= levels[0]).sum()), b) for s, b in zip(scores[layer], shares[layer])]
                    for layer in layers}
        lowest = float(levels[int(fits.max())])
        excluded = flat[flat < lowest]
        used = min(self.threshold, -float(excluded.max())) if excluded.numel() else self.threshold
        self.profile = {"threshold": used, "policies": {
            layer: [POLICIES[policy_at(self._recovery[layer][h], used)] for h in range(len(scores[layer]))]
            for layer in layers}}
        return {layer: [int((s.double() >= lowest).sum()) for s in scores[layer]] for layer in layers}

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        """The highest scores; within a policy's tokens (equal scores), the latest first (only a cut inside the
        special tokens, when they alone exceed the budget, needs it)."""
        by_recency = head.positions.argsort(descending=True)
        order = by_recency[score[by_recency].argsort(descending=True, stable=True)]
        return order[:n_keep]

    @torch.no_grad()
    def profile_prompt(self, lm, ids: list[int]) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """Per layer: (KV heads, len(ids)) the policy each prompt token enters at (0 special ... 4 full), and
        (KV heads, 4) each head's recovery under the first four policies."""
        n = len(ids)
        special, punct = special_mask(lm.tokenizer, ids), punct_mask(lm.tokenizer, ids)
        n_frequent = math.ceil(self.frequent * n)
        window = max(1, int(self.local * n))
        empty = KVCache(lm.model.config, observe_window=0)
        windows = [layer.sliding_window for layer in empty.layers]
        levels, recovery = {}, {}

        def record(idx: int, queries: Tensor, keys: list[Tensor], positions: list[Tensor], new_pos: Tensor, scaling: float):
            g = queries.shape[0] // len(keys)
            per_head = [profile_head(queries[h * g:(h + 1) * g], k, p, new_pos, scaling, windows[idx], special, punct,
                                     n_frequent, window) for h, (k, p) in enumerate(zip(keys, positions))]
            levels[idx] = torch.stack([lv for lv, _ in per_head])
            recovery[idx] = torch.stack([r for _, r in per_head])

        replay(lm, empty, ids, record)
        return levels, recovery


def profile_head(queries: Tensor, keys: Tensor, key_pos: Tensor, query_pos: Tensor, scaling: float,
                 sliding: int | None, special: Tensor, punct: Tensor, n_frequent: int, window: int) -> tuple[Tensor, Tensor]:
    """One KV head: each prompt token's policy level and the recovery of policies 0-3 (mean over the group's queries
    of the attention on what each keeps). `key_pos` are the prompt's positions 0..n-1 (a replay from empty)."""
    n = key_pos.numel()
    column = torch.zeros(n, dtype=torch.float64)  # attention each key receives, summed over queries, group mean
    band = torch.zeros(n, dtype=torch.float64)  # the part from queries less than `window` after it
    for s in range(0, queries.shape[1], BLOCK):
        qp = query_pos[s:s + BLOCK]
        logits = causal_logits(queries[:, s:s + BLOCK], keys, key_pos, qp, scaling)
        if sliding is not None:
            logits.masked_fill_(key_pos[None, None, :] <= qp[None, :, None] - sliding, float("-inf"))
        att = logits.softmax(dim=-1).nan_to_num(0.0).mean(dim=0).double()  # (Q, n), group mean
        column += att.sum(dim=0)
        near = (qp[:, None] - key_pos[None, :]) < window
        band += (att * near).sum(dim=0)
    rows = float(query_pos.numel())
    level = torch.full((n,), 4, dtype=torch.long)
    level[punct] = 1
    level[special] = 0
    rest = (level == 4).nonzero()[:, 0]
    frequent = rest[column[rest].topk(min(n_frequent, rest.numel())).indices]
    level[frequent] = 2
    level[(level == 4) & (key_pos >= n - window)] = 3  # the cache's local window: the last `window` tokens
    kept = [column[level <= j].sum() for j in range(3)]
    kept.append(kept[2] + band[level > 2].sum())  # + the keys within `window` of each query, the others not kept yet
    return level, (torch.stack(kept) / rows).float()


def level_scores(level: Tensor, recovery: Tensor) -> Tensor:
    """A token entering at policy j scores -recovery[j - 1]: kept by threshold T exactly when T > recovery[j - 1], i.e.
    when the head's first policy reaching T is j or later. Special tokens (j = 0) score +inf."""
    before = torch.cat([torch.tensor([float("-inf")]), recovery.float()])  # recovery of the policy before each level
    return -before[level]


def policy_at(recovery: Tensor, threshold: float) -> int:
    """The first policy whose recovery is >= threshold (full, 4, when none of the first four is)."""
    ok = (recovery >= threshold).nonzero()
    return int(ok[0]) if ok.numel() else 4

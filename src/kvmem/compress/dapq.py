"""`dapq`: the attention of pseudo queries placed at the positions of the first output tokens.

Tian, Su, Li and Zhang 2026, "Where Matters More Than What: Decoding-aligned KV Cache Compression via
Position-aware Pseudo Queries" (DapQ, arXiv 2603.11564). Which keys a query attends to depends more on its RoPE
position than on its content, so queries made at the positions generation will use stand in for the unknown
decoding queries. N = `window` pseudo tokens (32, the paper's default) are appended after the prompt with the
position ids of the first N output tokens, L_p .. L_p+N-1, and run through the model; in every layer their
queries (after RoPE) attend causally over the prompt and the pseudo tokens, and a prompt token's score is the
softmax attention the N pseudo queries give it, summed (averaged over the query heads sharing a KV head) and
max-pooled over neighbouring tokens (`kernel_size`, 7). The budget goes to the top-scoring prompt tokens; the
pseudo tokens run on a copy of the cache that is dropped, so decoding starts at L_p as if they had never been.

Content: the paper's prefix + suffix construction, the prompt's first `prefix` (4) and last N - prefix tokens
(its ablation finds content matters little next to position). It reads no question: only the cache and
`context.ids`, the ids it holds from position 0. L_p is the position after the cache's last token; where the
question is fed after compression (kvmem's query-agnostic use), the answer starts len(question) later.

Read from the paper's summaries (§3-6, its HTML; no reference code was found), not its text: the max-pool
(kernel 7, SnapKV's in KVCache-Factory, the framework of the paper's baselines; `kernel_size=1` turns it off),
and that no sink or recent tokens are reserved (the paper keeps the top-K prompt tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, causal_logits, replay
from kvmem.errors import KVMemError


class DapQ(Method):
    name = "dapq"
    needs_model = True

    def __init__(self, window: int = 32, prefix: int = 4, kernel_size: int = 7):
        if window < 1 or not 0 <= prefix <= window:
            raise KVMemError(f"dapq needs window >= 1 pseudo tokens and 0 <= prefix <= window; got window={window}, "
                             f"prefix={prefix}")
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise KVMemError(f"dapq needs an odd kernel_size >= 1; got kernel_size={kernel_size}")
        self.window, self.prefix, self.kernel_size = window, prefix, kernel_size

    def pseudo_ids(self, ids: list[int]) -> list[int]:
        """The pseudo tokens' content: the prompt's first `prefix` and last `window - prefix` tokens."""
        return ids[:self.prefix] + ids[max(0, len(ids) - (self.window - self.prefix)):]

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        key = ("dapq", self.window, self.prefix, cache.get_seq_length())
        if key not in context.memo:  # one pseudo pass serves every keep ratio of copies of one cache
            context.memo[key] = self.votes(cache, context)
        out = {}
        for i, heads in views.items():
            out[i] = []
            for view in heads:
                s = context.memo[key][i][view.head][view.positions.long()]
                if self.kernel_size > 1:  # neighbours of a voted token come along, as SnapKV pools its votes
                    s = F.max_pool1d(s[None, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)[0, 0]
                out[i].append(s)
        return out

    @torch.no_grad()
    def votes(self, cache: KVCache, context: ModelContext) -> list[Tensor]:
        """Per layer, (KV heads, positions): the attention the pseudo queries give each held token."""
        lm, n = context.lm, cache.get_seq_length()
        pseudo = self.pseudo_ids(list(context.ids))
        if not pseudo:
            raise KVMemError("dapq builds its pseudo tokens from the prompt: pass context=ModelContext(lm, ids)")
        if n + len(pseudo) > lm.max_context:
            raise KVMemError(f"dapq needs room for {len(pseudo)} pseudo tokens after {n} cached: {lm.name} allows "
                             f"{lm.max_context}; use a smaller window")
        windows = [layer.sliding_window for layer in cache.layers]
        votes: list[Tensor] = [torch.zeros(0)] * len(cache.layers)

        def record(idx: int, queries: Tensor, keys: list[Tensor], positions: list[Tensor], new_pos: Tensor, scaling: float):
            g = queries.shape[0] // len(keys)
            rows = []
            for h, (k, p) in enumerate(zip(keys, positions)):
                logits = causal_logits(queries[h * g:(h + 1) * g], k, p, new_pos, scaling)
                if windows[idx] is not None:  # a pseudo query sees what its sliding window shows it
                    logits.masked_fill_(p[None, None, :] <= new_pos[None, :, None] - windows[idx], float("-inf"))
                attn = logits.softmax(dim=-1).sum(dim=1).mean(dim=0)  # over prompt and pseudo keys, as attention is
                row, held = attn.new_zeros(n), p < new_pos[0]  # the pseudo tokens' own keys are dropped
                row[p[held].long()] = attn[held]
                rows.append(row)
            votes[idx] = torch.stack(rows)

        replay(lm, cache, pseudo, record)
        return votes

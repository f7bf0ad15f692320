"""`kvzip`: keep the KV pairs the model needs to reconstruct its context.

Kim et al. 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (arXiv
2505.23416; reference code github.com/snu-mllab/KVzip). A pair that matters for *some* future question
is one the model reads when asked to repeat the context. After the prefill, the document is fed again,
in chunks, behind "Repeat the previous context exactly." (later chunks: "Repeat the part of the previous
context exactly, starting with" + the last 8 tokens of the previous chunk) and the end of the user
turn. A pair's score is the largest attention any query of its group gives it while its own chunk is
reproduced, the softmax taken, as in the reference, over the template head (the "sink": system prompt),
the chunk and the repeat tokens. The template head is always kept, and the budget is `global` by
default: one threshold over all layers and heads (the paper's non-uniform head budgets).

The reconstruction runs on a copy of the cache that is dropped afterwards: the cost is about one more
prefill, paid once for a cache that is then reused (the benchmark reports it as a multiple of the
prefill). Sliding-window layers score the tokens they hold the same way (the reference computes this
attention without a window). The reference compresses only Gemma-3's global layers: that is
`kvzip:sliding=keep`; by default, like every kvmem method, sliding layers are compressed too, so the keep
ratio is a fraction of all the cache's bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, replay
from kvmem.errors import KVMemError
from kvmem.prompts import user_turn_end

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "


class KVzip(Method):
    name = "kvzip"
    needs_model = True
    budget = "global"

    def __init__(self, chunk: int = 2000, overlap: int = 8):
        if chunk < 1 or overlap < 0:
            raise KVMemError(f"kvzip needs chunk >= 1 and overlap >= 0; got chunk={chunk}, overlap={overlap}")
        self.chunk, self.overlap = chunk, overlap

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        key = ("kvzip", self.chunk, self.overlap, cache.get_seq_length())
        if key not in context.memo:  # one reconstruction serves every keep ratio of copies of one cache
            context.memo[key] = self.pair_scores(cache, context)
        by_position = context.memo[key]
        out = {}
        for i, heads in views.items():
            out[i] = []
            for view in heads:
                s = by_position[i][view.head][view.positions.long()]
                out[i].append(s.masked_fill(view.positions < context.head, float("inf")))
        return out

    @torch.no_grad()
    def pair_scores(self, cache: KVCache, context: ModelContext) -> list[Tensor]:
        """Per layer, (KV heads, positions) max reconstruction attention; 0 where nothing was scored."""
        lm, ids, head = context.lm, list(context.ids), context.head
        if any(layer.evicted() for layer in cache.layers) or len(ids) > cache.get_seq_length():
            raise KVMemError("kvzip scores an uncompressed cache holding `context.ids` from position 0")
        tok = lm.tokenizer
        encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
        turn_end = user_turn_end(tok, raw=tok.chat_template is None)
        doc = ids[head:]
        scores = [torch.zeros((len(layer.lengths()), cache.get_seq_length())) for layer in cache.layers]
        for c0 in range(0, len(doc), self.chunk):
            part = doc[c0:c0 + self.chunk]
            prompt = encode(REPEAT_FIRST) if c0 == 0 else encode(REPEAT_NEXT) + doc[max(0, c0 - self.overlap):c0]
            repeat = prompt + turn_end + part
            if cache.get_seq_length() + len(repeat) > lm.max_context:
                room = lm.max_context - cache.get_seq_length() - len(prompt + turn_end)
                hint = (f"use a chunk of at most {room} tokens" if room > 0 else
                        f"no chunk fits: leave at least {len(prompt + turn_end) + 1} of the model's tokens free")
                raise KVMemError(f"kvzip needs room to reconstruct a chunk: {cache.get_seq_length()} cached + "
                                 f"{len(repeat)} tokens > {lm.max_context} that {lm.name} allows; {hint}")
            self._score_chunk(lm, cache, repeat, head, head + c0, head + c0 + len(part), scores)
        return scores

    def _score_chunk(self, lm, cache: KVCache, repeat: list[int], sink: int, c0: int, c1: int, scores: list[Tensor]) -> None:
        def record(idx: int, queries: Tensor, keys: list[Tensor], positions: list[Tensor], new_pos: Tensor, scaling: float):
            groups = queries.shape[0] // len(keys)
            for h, (k, p) in enumerate(zip(keys, positions)):
                sel = (p < sink) | ((p >= c0) & (p < c1)) | (p >= new_pos[0])
                k, p = k[sel], p[sel]
                # the chunk's keys are one contiguous run (positions increase)
                lo = int(torch.searchsorted(p, torch.tensor(c0, dtype=p.dtype)))
                hi = int(torch.searchsorted(p, torch.tensor(c1, dtype=p.dtype)))
                if hi > lo:
                    scores[idx][h, p[lo:hi].long()] = max_attention(queries[h * groups:(h + 1) * groups], k, p, new_pos,
                                                                    scaling, lo, hi)

        replay(lm, cache, repeat, record)


def max_attention(queries: Tensor, keys: Tensor, key_pos: Tensor, query_pos: Tensor, scaling: float, lo: int, hi: int,
                  block: int = 64) -> Tensor:
    """For each key in `keys[lo:hi]`, the largest causal softmax attention any of `queries` (group, Q, D) gives
    it: exp(max(logit - logsumexp of the query's row)). In blocks of queries, so that a block's logits stay in
    the CPU cache across the few passes this takes (3-6x faster than one pass over all queries)."""
    q, k = queries.float() * scaling, keys.float()  # scaling the queries costs less than the logits
    best = q.new_full((hi - lo,), float("-inf"))
    for s in range(0, q.shape[1], block):
        qp = query_pos[s:s + block]
        end = int(torch.searchsorted(key_pos, qp.max(), right=True))  # keys after `end` are in every query's future
        start = int(torch.searchsorted(key_pos, qp.min(), right=True))  # keys before `start` are in none's
        logits = q[:, s:s + block] @ k[:end].T
        logits[..., start:end].masked_fill_(key_pos[None, None, start:end] > qp[None, :, None], float("-inf"))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        top = min(end, hi)
        if top > lo:
            torch.maximum(best[:top - lo], (logits[..., lo:top] - lse).amax(dim=(0, 1)), out=best[:top - lo])
    return best.exp()

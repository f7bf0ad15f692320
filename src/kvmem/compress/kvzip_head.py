"""`kvzip-head`: KVzip's context-independent, head-level variant.

Kim et al. 2025 (KVzip, arXiv 2505.23416), head-level eviction: a head's importance is the largest
KVzip pair score it gives anywhere in a calibration context (the reference code saves
`score.amax(-1)` per head from one sample and takes the max over saved samples). At compression every
token of a head gets its head's score, so the `global` threshold keeps whole heads: the important heads
keep the full context, the others only the template head (the reference's "sink", the system prompt).
No rerun of the model per context: the scores are fitted once per model fingerprint on the shipped
abstracts (`calibration.py`). Ties inside the head at the threshold go to the most recent tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext
from kvmem.calibration import calibration_ids, load_or_fit
from kvmem.compress.kvzip import KVzip
from kvmem.errors import KVMemError


class KVzipHead(Method):
    name = "kvzip-head"
    needs_model = True
    budget = "global"

    def __init__(self, sequences: int = 2, length: int = 2000):
        if sequences < 1 or length < 16:
            raise KVMemError(f"kvzip-head needs sequences >= 1 and length >= 16; got {sequences}, {length}")
        self.sequences, self.length = sequences, length

    def head_scores(self, lm) -> dict[str, Tensor]:
        params = dict(sequences=self.sequences, length=self.length)
        return load_or_fit(lm, "kvzip-head", params, lambda: fit_head_scores(lm, **params))

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        scores = self.head_scores(context.lm)
        out = {}
        for i, heads in views.items():
            out[i] = []
            for view in heads:
                recency = view.positions.float() / (cache.get_seq_length() + 1) * 1e-6  # tie-break only
                s = scores[f"layer.{i}"][view.head] + recency
                out[i].append(s.masked_fill(view.positions < context.head, float("inf")))
        return out


@torch.no_grad()
def fit_head_scores(lm, sequences: int, length: int) -> dict[str, Tensor]:
    """Max KVzip pair score per (layer, KV head) over chat-formatted calibration documents."""
    from kvmem.forward import feed
    from kvmem.prompts import build_prompt

    best: dict[int, Tensor] = {}
    for ids in calibration_ids(lm.tokenizer, sequences, length):
        prompt = build_prompt(lm.tokenizer, lm.tokenizer.decode(ids), "Summarize the text.",
                              raw=lm.tokenizer.chat_template is None)
        cache = KVCache(lm.model.config, observe_window=1)
        feed(lm, cache, prompt.context)
        pair = KVzip().pair_scores(cache, ModelContext(lm, prompt.context, prompt.head))
        for i, s in enumerate(pair):
            head_max = s[:, prompt.head:].amax(dim=-1)
            best[i] = head_max if i not in best else torch.maximum(best[i], head_max)
    return {f"layer.{i}": s for i, s in best.items()}

"""`sentencekv`: sentence-level semantic KV retrieval.

"SentenceKV: Efficient LLM Inference via Sentence-Level Semantic KV Caching" (2025; abstract in the seeds):
during prefill, tokens are grouped into sentences and each sentence is compressed into a semantic vector kept on the
accelerator while its KV pairs are offloaded; each decoding step retrieves the sentences whose semantic vectors are
most similar to its queries. Here: sentences end at a token whose text has `.`, `!`, `?` or a newline (longer ones are
cut at `max_len` tokens); a sentence's semantic vector is its mean key per KV head (resident, counted in the resident
bytes); a head's sentences are ranked by the attention its query group's queries would pay them (softmax over the
semantic vectors, averaged over the queries) and taken, best first, while they fit the buffer. The abstract is silent
on the exact sentence split and similarity; these are our choices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod, fill, span_means, span_rows
from kvmem.errors import KVMemError

ENDINGS = (".", "!", "?", "\n")


def sentence_spans(ids: list[int], tokenizer_ends: set[int], n: int, max_len: int) -> tuple[Tensor, Tensor]:
    """[start, end) spans over `n` rows whose token ids are `ids`: a span ends after a sentence-ending token or at
    `max_len` rows."""
    starts, start = [], 0
    for i, t in enumerate(ids[:n]):
        if t in tokenizer_ends or i + 1 - start >= max_len:
            starts.append(start)
            start = i + 1
    if start < n:
        starts.append(start)
    s = torch.tensor(starts, dtype=torch.long)
    return s, torch.cat([s[1:], torch.tensor([n])])


class SentenceKV(OffloadMethod):
    name = "sentencekv"
    needs_ids = True

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8", max_len: int = 64):
        super().__init__(sink, recent, tier)
        if max_len < 1:
            raise KVMemError(f"sentencekv: max_len must be >= 1 (got {max_len})")
        self.max_len = max_len
        self.ending_ids: set[int] | None = None  # set from the tokenizer (`offload` via the ModelContext)

    def offload(self, cache, ratios, context, protect_from=None):
        if context is not None:
            self.ending_ids = ending_ids(context.lm.tokenizer)
        return super().offload(cache, ratios, context, protect_from)

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        if ids is None or self.ending_ids is None:
            raise KVMemError("sentencekv builds its sentences from the token ids: pass context=ModelContext(lm, ids)")
        pos = positions[0].tolist()
        if int(positions[0, -1]) >= len(ids):
            raise KVMemError(f"sentencekv: the context's ids ({len(ids)}) do not cover the rows held")
        starts, ends = sentence_spans([ids[p] for p in pos], self.ending_ids, len(pos), self.max_len)
        return {"resident": [span_means(keys, starts, ends)], "state": [starts, ends], "starts": starts, "ends": ends}

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor]:
        vectors = rows.index["resident"][0]
        starts, ends = rows.index["starts"], rows.index["ends"]
        chosen = []
        for h, q in enumerate(queries):
            attention = (q.float() @ vectors[h].float().T * scaling).softmax(-1)  # (group, Q, sentences)
            order = attention.mean((0, 1)).argsort(descending=True)
            chosen.append(span_rows(starts, ends, fill(order, ends - starts, rows.capacity)))
        return chosen


_ENDING_IDS: dict[int, set[int]] = {}


def ending_ids(tokenizer) -> set[int]:
    """Every token whose text holds a sentence ending (cached per tokenizer)."""
    if id(tokenizer) not in _ENDING_IDS:
        _ENDING_IDS[id(tokenizer)] = {i for t, i in tokenizer.get_vocab().items()
                                      if any(e in tokenizer.convert_tokens_to_string([t]) for e in ENDINGS)}
    return _ENDING_IDS[id(tokenizer)]

"""`ltri`: spans kept in an offline index, retrieved by the heads' collaborative vote.

"Ltri-LLM: Streaming Long Context Inference for LLMs with Training-Free Dynamic Triangular Attention Pattern"
(2024; abstract in the seeds): attention shows strong local correlation, so the KV is divided into spans,
stored in an offline index, and the spans relevant to each query are retrieved into memory. Here: the spans are
`span` consecutive rows (the paper finds span boundaries from the triangular attention pattern; we cut fixed spans:
our simplification); the index holds one summary key per span and head (the span's mean key), packed at the tier's
precision and kept *offline* (in the tier, counted in the offloaded bytes, decoded for each lookup); every query head
ranks the spans by its best query's logit and votes for those that fill the buffer, and all KV heads of the layer
retrieve the spans with the most votes (the paper's retrieval is shared across heads; the vote is our reading of it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod, fill, fixed_spans, span_means, span_rows
from kvmem.compress.offload.rows import Tier
from kvmem.errors import KVMemError


class Ltri(OffloadMethod):
    name = "ltri"

    def __init__(self, sink: int = 4, recent: int = 32, tier: str = "int8", span: int = 16):
        super().__init__(sink, recent, tier)
        if span < 1:
            raise KVMemError(f"ltri: span must be >= 1 (got {span})")
        self.span = span

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        starts, ends = fixed_spans(keys.shape[1], self.span)
        means = span_means(keys, starts, ends)
        index = Tier(means, None, starts[None].expand(keys.shape[0], -1).to(torch.int32), self.tier)
        return {"offline": index.tensors(), "state": [starts, ends], "summaries": index, "starts": starts, "ends": ends}

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor]:
        index, starts, ends = rows.index["summaries"], rows.index["starts"], rows.index["ends"]
        sizes = ends - starts
        every = torch.arange(starts.numel())
        votes = torch.zeros(starts.numel())
        for h, q in enumerate(queries):
            summaries = index.decode_keys(h, every)  # looked up in the offline index
            best = (q.float() @ summaries.float().T * scaling).amax(1)  # (group, spans): each query head's best query
            for g in range(best.shape[0]):
                votes[fill(best[g].argsort(descending=True), sizes, rows.capacity)] += 1
                votes += best[g].softmax(-1) * 1e-3  # ties go to the spans the heads favour more
        spans = fill(votes.argsort(descending=True), sizes, rows.capacity)
        return [span_rows(starts, ends, spans)] * len(queries)

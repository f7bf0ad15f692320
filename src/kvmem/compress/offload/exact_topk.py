"""`exact-topk`: the retrieval every offload policy approximates, as a yardstick (no paper; not a method to deploy).

Each forward, every KV head scores all of its offloaded rows with the queries in hand (the keys decoded from the
tier: the tier's precision, nothing summarized) and retrieves the rows with the most attention (the largest softmax
weight any query of its group gives them) that fill the buffer. It reads the whole tier every forward, so it saves
no bandwidth; what it tells is how much of the full cache's score retrieval at this resident budget can keep at
all, which separates the mechanism's limit (the buffer) from a policy's (its summaries and its units).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.compress.offload.base import OffloadMethod


class ExactTopK(OffloadMethod):
    name = "exact-topk"

    def build_index(self, keys: Tensor, positions: Tensor, ids, layer) -> dict:
        return {"resident": [], "state": []}

    def retrieve(self, rows, queries: list[Tensor], scaling: float) -> list[Tensor]:
        every = torch.arange(rows.tier.rows)
        chosen = []
        for h, q in enumerate(queries):
            keys = rows.tier.decode_keys(h, every).float()
            weight = (q.float().reshape(-1, q.shape[-1]) @ keys.T * scaling).softmax(-1).amax(0)
            chosen.append(weight.topk(min(rows.capacity, weight.numel())).indices.sort().values)
        return chosen

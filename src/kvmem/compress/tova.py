"""`tova`: Token Omission Via Attention.

Oren et al. 2024, "Transformers are Multi-State RNNs" (arXiv 2401.06104): keep the tokens the
current (last) query attends to most. As in the paper, the score is the last token's attention
averaged over all heads of the layer, so a layer keeps the same tokens in every head (when its
heads hold the same tokens; after per-head eviction each KV head uses its own query group).
"""

import torch
from torch import Tensor

from kvmem.compress.base import HeadView, Method


class TOVA(Method):
    name = "tova"
    observe_window = 1

    def score(self, head: HeadView) -> Tensor:
        return head.query_attention(last=1)[:, 0].mean(dim=0)

    def score_layer(self, heads: list[HeadView]) -> list[Tensor]:
        per_head = [self.score(h) for h in heads]
        aligned = all(torch.equal(h.positions, heads[0].positions) for h in heads)
        if not aligned:
            return per_head
        mean = torch.stack(per_head).mean(dim=0)
        return [mean] * len(heads)

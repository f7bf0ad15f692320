"""`streaming-llm`: attention sinks + a recent window.

Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks" (arXiv 2309.17453):
keeping the KV of the first few tokens (4 in the paper) recovers window attention, because models
dump attention on them; the rest of the budget is the most recent tokens.
Positions: kvmem keeps original positions (the paper re-indexes positions inside the cache, which
matters for streaming past the trained length, not for compressing a prompt of trained length).
"""

import torch
from torch import Tensor

from kvmem.compress.base import HeadView, Method


class StreamingLLM(Method):
    name = "streaming-llm"

    def __init__(self, n_sink: int = 4):
        self.n_sink = n_sink

    def score(self, head: HeadView) -> Tensor:
        score = head.positions.float()  # recency
        first = head.positions.min() if head.positions.numel() else 0
        return torch.where(head.positions < first + self.n_sink, torch.tensor(float("inf")), score)

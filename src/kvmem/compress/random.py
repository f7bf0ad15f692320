"""`random`: keep a uniformly random subset of tokens per head (a floor every method should beat)."""

import torch
from torch import Tensor

from kvmem.compress.base import HeadView, Method


class Random(Method):
    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def score(self, head: HeadView) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + head.layer * 101 + head.head)
        return torch.rand(head.positions.shape[0], generator=g)

"""`curdkv`: value-centric selection by CUR leverage scores.

CurDKV (arXiv 2509.15038, abstract in shared/seeds): attention output softmax(QK^T)V is best preserved by keeping the rows of K
and V with high leverage scores, the rows a CUR decomposition would pick. As in the authors' code,
leverage is approximated by squared row norms (optionally after a Gaussian projection to `rank`
dimensions), normalized within local windows of `window` tokens so every stretch of the context keeps
some rows; key and value leverage are multiplied. The first `n_sink` tokens are always kept.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError


class CurDKV(Method):
    name = "curdkv"

    def __init__(self, window: int = 16, n_sink: int = 4, rank: int = 0, seed: int = 0):
        if window < 0 or n_sink < 0 or rank < 0:
            raise KVMemError(f"curdkv needs window, n_sink and rank >= 0 (0: off); got {window}, {n_sink}, {rank}")
        self.window, self.n_sink, self.rank, self.seed = window, n_sink, rank, seed

    def _leverage(self, rows: Tensor, head: HeadView) -> Tensor:
        if self.rank:  # random projection: row norms of X G estimate leverage of X (Drineas et al.)
            g = torch.Generator().manual_seed(self.seed * 1009 + head.layer * 31 + head.head)
            rows = rows @ (torch.randn(rows.shape[-1], self.rank, generator=g) / math.sqrt(self.rank))
        sq = rows.pow(2).sum(dim=-1)
        if not self.window:
            return sq / sq.sum()
        n, w = sq.numel(), self.window
        blocks = F.pad(sq, (0, -n % w)).reshape(-1, w)
        return (blocks / blocks.sum(dim=-1, keepdim=True).clamp_min(1e-30)).reshape(-1)[:n]

    def score(self, head: HeadView) -> Tensor:
        score = self._leverage(head.keys.float(), head) * self._leverage(head.values.float(), head)
        first = head.positions.min() if head.positions.numel() else 0
        return score.masked_fill(head.positions < first + self.n_sink, float("inf"))

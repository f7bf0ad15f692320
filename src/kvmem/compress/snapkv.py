"""`snapkv`: observation-window attention, pooled.

Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation" (arXiv 2404.14469):
the attention of the last `window` prompt tokens (the observation window) over the prefix predicts
which tokens generation will attend to. Votes are summed over the window, smoothed with a 1-D max
pool (kernel 7) so neighbours of a selected token come along, and the window itself is always kept.
With GQA, votes are averaged over the query heads that share a KV head.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError


class SnapKV(Method):
    name = "snapkv"
    observe_window = 32

    def __init__(self, window: int = 32, kernel_size: int = 7):
        if window < 1 or kernel_size < 1 or kernel_size % 2 == 0:
            raise KVMemError(f"snapkv needs window >= 1 and an odd kernel_size >= 1; got window={window}, "
                             f"kernel_size={kernel_size}")
        self.window, self.kernel_size = window, kernel_size
        self.observe_window = window  # the cache must keep this many recent queries

    def score(self, head: HeadView) -> Tensor:
        votes = head.query_attention(last=self.window).sum(dim=1).mean(dim=0)  # (T,)
        in_window = head.positions >= head.query_positions[-self.window:].min()
        prefix = votes[~in_window]  # pooled on its own, as in the paper, so window votes do not leak into it
        score = torch.full_like(votes, float("inf"))
        if prefix.numel():  # a context no longer than the window has no prefix to choose from
            score[~in_window] = F.max_pool1d(prefix[None, None], self.kernel_size, stride=1,
                                             padding=self.kernel_size // 2)[0, 0]
        return score

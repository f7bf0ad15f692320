"""`h2o`: Heavy-Hitter Oracle.

Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (arXiv 2306.14048): a few tokens ("heavy hitters") collect most of the accumulated attention;
keep them plus the most recent tokens, half of the budget each (the paper's default split).
Accumulated attention is the column sum of softmax attention over every query seen (prefill and
decode), averaged over the query heads sharing a KV head.
"""

from torch import Tensor

from kvmem.compress.base import HeadView, Method, keep_recent_and_top


class H2O(Method):
    name = "h2o"
    needs_attention = True

    def __init__(self, recent_fraction: float = 0.5):
        self.recent_fraction = recent_fraction

    def score(self, head: HeadView) -> Tensor:
        return head.attention.mean(dim=0)

    def select(self, head: HeadView, score: Tensor, n_keep: int) -> Tensor:
        return keep_recent_and_top(head, score, n_keep, int(n_keep * self.recent_fraction))

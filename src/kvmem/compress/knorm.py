"""`knorm`: keep the keys with the lowest L2 norm.

Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(arXiv 2406.11430): a low key norm correlates with high attention, so dropping the highest-norm
keys needs no attention scores at all.
"""

from torch import Tensor

from kvmem.compress.base import HeadView, Method


class KNorm(Method):
    name = "knorm"
    signed_scores = True  # minus the key norm

    def score(self, head: HeadView) -> Tensor:
        return -head.keys.float().norm(dim=-1)

"""`keydiff`: keep the keys least similar to the others.

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv 2504.15364): keys that point away from the head's mean key
direction are the distinctive ones attention can single out; keys close to it are redundant. Score =
minus the cosine similarity of each key to the mean of the normalized keys. Needs no attention at all,
so it suits the query-agnostic setting. (The paper applies it block by block while prefilling under a
fixed memory cap; on a prompt already in memory that is one block, as here and in kvpress.)
"""

import torch.nn.functional as F
from torch import Tensor

from kvmem.compress.base import HeadView, Method


class KeyDiff(Method):
    name = "keydiff"

    def score(self, head: HeadView) -> Tensor:
        keys = head.keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=0)
        return -F.cosine_similarity(keys, anchor[None], dim=-1)

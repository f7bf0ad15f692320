"""`keydiff`: keep the keys least similar to the others.

Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments" (arXiv 2504.15364): keys that point away from the head's mean key
direction are the distinctive ones attention can single out; keys close to it are redundant. Score =
minus the cosine similarity of each key to the mean of the normalized keys. Needs no attention at all,
so it suits the query-agnostic setting. (The paper applies it block by block while prefilling under a
fixed memory cap; on a prompt already in memory that is one block, as here and in kvpress.)

`kernel_size` (default 1: the paper's scorer) is not KeyDiff's: it max-pools the scores over that many
neighbouring rows, as SnapKV pools its votes, so a distinctive key keeps its neighbours. A fact is then kept
with the words that lead to it (a needle's number with its key phrase), which keydiff alone drops on
Gemma-3 (README, "Of note").
"""

import torch.nn.functional as F
from torch import Tensor

from kvmem.compress.base import HeadView, Method
from kvmem.errors import KVMemError


class KeyDiff(Method):
    name = "keydiff"
    signed_scores = True  # minus a cosine similarity

    def __init__(self, kernel_size: int = 1):
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise KVMemError(f"keydiff needs an odd kernel_size >= 1; got kernel_size={kernel_size}")
        self.kernel_size = kernel_size

    def score(self, head: HeadView) -> Tensor:
        keys = head.keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=0)
        score = -F.cosine_similarity(keys, anchor[None], dim=-1)
        if self.kernel_size > 1:
            score = F.max_pool1d(score[None, None], self.kernel_size, stride=1, padding=self.kernel_size // 2)[0, 0]
        return score

"""`mean` and `last`: plain pooling of one layer's hidden states, the training-free baselines.

`mean` averages the hidden states of the text's tokens. By default it leaves out the first token: in the
middle layers of these small LMs the first position is an attention sink (Xiao et al. 2023, arXiv
2309.17453) whose hidden state has a norm of ~23,800 against ~200 for the others (SmolLM2-135M), so it
dominates the mean and makes every text look alike; skipping it raised layer-15 nDCG@10 from 0.033 to
0.155 in issue 3's check. `last` takes the last real token's state, the only one that has seen the whole
text under causal attention (the pooling of e.g. Neelakantan et al. 2022 and most LLM embedders).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.embed.base import LMEmbedder


def mean_pool(hidden: Tensor, mask: Tensor, skip_first: bool = True) -> Tensor:
    """(B, T, D) states, (B, T) right-padded mask -> (B, D) mean over real tokens (the first left out)."""
    weights = mask.clone().float()
    if skip_first:
        weights[:, 0] = (mask.sum(1) == 1).float()  # a one-token text keeps its only token
    return (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True)


def last_token(hidden: Tensor, mask: Tensor) -> Tensor:
    """(B, T, D) states, (B, T) right-padded mask -> (B, D) state of each row's last real token."""
    return hidden[torch.arange(len(hidden)), mask.sum(1) - 1]


class MeanPooling(LMEmbedder):
    name = "mean"

    def __init__(self, model, tokenizer, layer: int = -1, skip_first: bool = True):
        super().__init__(model, tokenizer, layer)
        self.skip_first = skip_first

    def _pool(self, hidden: Tensor, mask: Tensor, batch, texts: list[str]) -> Tensor:
        return mean_pool(hidden, mask, self.skip_first)


class LastToken(LMEmbedder):
    name = "last"

    def _pool(self, hidden: Tensor, mask: Tensor, batch, texts: list[str]) -> Tensor:
        return last_token(hidden, mask)

"""`echo`: repeat the input and mean-pool over the second copy.

Springer et al. 2024, "Repetition Improves Language Model Embeddings" (arXiv 2402.15449): under causal
attention a token cannot see later tokens; in `Rewrite the sentence: {x}\nRewritten sentence: {x}` every
token of the second copy has already read the whole text once. The embedding is the mean of the hidden
states at `layer` over the tokens of the second copy only (found from the tokenizer's character offsets).
"""

from __future__ import annotations

from torch import Tensor

from kvmem.embed.base import LMEmbedder, check_template

TEMPLATE = "Rewrite the sentence: {text}\nRewritten sentence: {text}"


class Echo(LMEmbedder):
    name = "echo"

    def __init__(self, model, tokenizer, layer: int = -1, template: str = TEMPLATE):
        super().__init__(model, tokenizer, layer)
        self.template = check_template(template, 2, self.name)

    def _texts(self, texts: list[str]) -> list[str]:
        return [self.template.format(text=t) for t in texts]

    def _pool(self, hidden: Tensor, mask: Tensor, batch, texts: list[str]) -> Tensor:
        tail = len(self.template.rpartition("{text}")[2])
        ends = [len(p) - tail for p in self._texts(texts)]  # character span of the second copy
        starts = [e - len(t) for e, t in zip(ends, texts)]
        offsets = batch["offset_mapping"]  # (B, T, 2) character span of each token
        weights = mask.bool().clone()
        for i, (s, e) in enumerate(zip(starts, ends)):
            weights[i] &= (offsets[i, :, 1] > s) & (offsets[i, :, 0] < e)  # tokens overlapping the copy
        weights = weights.float()
        return (hidden * weights[..., None]).sum(1) / weights.sum(1, keepdim=True).clamp(min=1.0)

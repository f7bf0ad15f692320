"""`prompteol`: the last token of an "in one word" prompt.

Jiang et al. 2023, "Scaling Sentence Embeddings with Large Language Models" (arXiv 2307.16645): wrap
the text in `This sentence : "{text}" means in one word:"` so the next-token state has to compress the
sentence's meaning into one word, and take the last token's hidden state at `layer`.
"""

from __future__ import annotations

from kvmem.embed.base import check_template
from kvmem.embed.pooling import LastToken

TEMPLATE = 'This sentence : "{text}" means in one word:"'


class PromptEOL(LastToken):
    name = "prompteol"

    def __init__(self, model, tokenizer, layer: int = -1, template: str = TEMPLATE):
        super().__init__(model, tokenizer, layer)
        self.template = check_template(template, 1, self.name)

    def _texts(self, texts: list[str]) -> list[str]:
        return [self.template.format(text=t) for t in texts]

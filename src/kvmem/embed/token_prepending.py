"""`token-prepending`: PromptEOL plus a placeholder token that carries the sentence embedding back to the start.

Fu et al. 2025, "Token Prepending: A Training-Free Approach for Eliciting Better Sentence Embeddings from
LLMs" (arXiv 2412.11556; official code github.com/fuyuchenIfyw/token_prepending, which we follow):
- the PromptEOL prompt gets a placeholder token <PST> in front of the sentence:
  `This sentence : <PST>"{text}" means in one word:"`;
- before each layer in [`start`, `exit`) the placeholder's hidden state is replaced by the *last* token's
  hidden state (the previous layer's sentence embedding), so every sentence token after it attends to a
  summary of the whole sentence under plain causal attention;
- the embedding is the last token's hidden state at `layer`, as in PromptEOL.
The official code gives <PST> a new vocabulary row drawn from N(0, 1) and uses start=1 with exit 3-7 of
32 layers; we draw that row from a seeded generator (deterministic embeddings) times the model's embedding
scale (Gemma multiplies its input embeddings by sqrt(hidden)), and default to exit = n_layers // 5
(6 of 30 for SmolLM2, 3 of 18 for Gemma-3). Nothing is added to the tokenizer: the batch is assembled
from token ids with the placeholder's row put into `inputs_embeds`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvmem.embed.base import this_thread_only
from kvmem.embed.pooling import LastToken
from kvmem.errors import KVMemError

PREFIX, SUFFIX = "This sentence : ", '"{text}" means in one word:"'


class TokenPrepending(LastToken):
    name = "token-prepending"

    def __init__(self, model, tokenizer, layer: int = -1, start: int = 1, exit: int | None = None, seed: int = 0):
        super().__init__(model, tokenizer, layer)
        if exit is not None and (isinstance(exit, bool) or not isinstance(exit, int)):
            raise KVMemError(f"token-prepending exit must be a layer number, got {exit!r}")
        exit = max(start + 1, self.n_layers // 5) if exit is None else exit
        if not 0 <= start < exit <= self.n_layers:
            raise KVMemError(f"token-prepending needs 0 <= start < exit <= {self.n_layers}, got {start}, {exit}")
        self.start, self.exit = start, exit
        embed = model.get_input_embeddings()
        generator = torch.Generator().manual_seed(seed)
        scale = float(getattr(embed, "embed_scale", 1.0))
        self.placeholder = torch.randn(embed.weight.shape[1], generator=generator).to(embed.weight.dtype) * scale

    def _tokenize(self, texts: list[str]):
        tok = self.tokenizer
        head = tok(PREFIX).input_ids  # with the tokenizer's BOS, if it adds one
        rows = [head + [tok.eos_token_id] + tok(SUFFIX.format(text=t), add_special_tokens=False).input_ids
                for t in texts]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.eos_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return {"input_ids": ids, "attention_mask": mask, "placeholder": len(head)}

    def _hidden_states(self, batch) -> tuple[Tensor, ...]:
        body, p = self.model.base_model, batch["placeholder"]
        last = batch["attention_mask"].sum(1) - 1
        embeds = body.get_input_embeddings()(batch["input_ids"])
        embeds[:, p] = self.placeholder

        def prepend(layer_idx: int):
            def hook(module, args, kwargs):
                hidden = args[0].clone()
                hidden[:, p] = hidden[torch.arange(len(hidden)), last]
                return (hidden, *args[1:]), kwargs
            return hook

        handles = [body.layers[i].register_forward_pre_hook(this_thread_only(prepend(i)), with_kwargs=True)
                   for i in range(self.start, self.exit)]
        try:
            return body(inputs_embeds=embeds, attention_mask=batch["attention_mask"], output_hidden_states=True,
                        use_cache=False).hidden_states
        finally:
            for h in handles:
                h.remove()

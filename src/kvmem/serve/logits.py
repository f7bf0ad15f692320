"""What the OpenAI API does to a token's logits besides temperature and top-p, and what it reports about them:
penalties, `logit_bias`, a grammar the output must match (JSON mode, forced tool calls), and the logprobs.

    shaper = Shaper(lm, sampling)                # one per choice: its own token counts and grammar state
    scores = shaper.shape(logits)                # penalties, bias and the grammar's mask applied (a copy)
    shaper.take(token)                           # counted, and fed to the grammar
    entry = token_logprob(lm.tokenizer, logits, token, top=5)   # from the raw logits (vLLM's default)

* **Penalties** follow OpenAI's formula over the tokens generated so far (not the prompt):
  `logit[t] - frequency_penalty * count[t] - presence_penalty * (count[t] > 0)`; `logit_bias` is added to the
  logits of the tokens it names. Both come before temperature and top-p.
* **Grammar**: llguidance (https://github.com/guidance-ai/llguidance, the constrained decoder vLLM and llama.cpp
  use) keeps an incremental parser of the output and, before each token, masks every token that would leave the
  grammar: the output parses by construction, and the end token is allowed only where the grammar is complete.
* **Logprobs** are `log_softmax` of the model's raw logits, before penalties, bias, the grammar's mask,
  temperature and top-p (vLLM's default `raw_logprobs`): what the model thinks of the token, not how it was drawn.
  A token's text and bytes are its own (byte-level BPE pieces mapped back to bytes, SentencePiece byte fallbacks
  `<0xNN>` as that byte), so a character split over two tokens shows as two byte lists and U+FFFD in the text.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.models import LoadedModel

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; vLLM's default max_logprobs is 20 too


@dataclass
class TokenLogprob:
    """One token of an answer (or of the prompt, for `echo`) with its logprob and the most likely alternatives."""

    text: str
    bytes: list[int]
    logprob: float | None  # None for the prompt's first token (nothing before it)
    top: list[tuple[str, list[int], float]] = field(default_factory=list)
    offset: int = 0  # where its text starts in the decoded output


# -- token texts --------------------------------------------------------------------------------------------------
_BYTE_LEVEL: dict[int, bool] = {}
_lock = threading.Lock()


def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


_BYTES = _byte_decoder()


def _is_byte_level(tokenizer) -> bool:
    key = id(tokenizer)
    if key not in _BYTE_LEVEL:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        _BYTE_LEVEL[key] = '"ByteLevel"' in json.dumps(decoder)
    return _BYTE_LEVEL[key]


def token_bytes(tokenizer, token: int) -> bytes:
    """The bytes one token stands for (see the module doc)."""
    piece = tokenizer.convert_ids_to_tokens(token)
    if piece is None:
        return b""
    if _is_byte_level(tokenizer) and all(c in _BYTES for c in piece):
        return bytes(_BYTES[c] for c in piece)
    if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
        return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode()  # SentencePiece's metaspace


def _described(tokenizer, token: int) -> tuple[str, list[int]]:
    b = token_bytes(tokenizer, token)
    return b.decode("utf-8", "replace"), list(b)


def token_logprob(tokenizer, logits: torch.Tensor, token: int, top: int, offset: int = 0) -> TokenLogprob:
    """`token`'s logprob under the raw `logits` and the `top` most likely tokens with theirs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = logprobs.topk(top)
        alternatives = [(*_described(tokenizer, int(i)), float(v)) for v, i in zip(values, ids)]
    return TokenLogprob(*_described(tokenizer, token), float(logprobs[token]), alternatives, offset)


@torch.no_grad()
def prompt_logprobs(lm: LoadedModel, ids: list[int], top: int, piece: int = 128) -> list[TokenLogprob]:
    """Each prompt token's logprob given the tokens before it (the first has none), from a forward of the whole
    prompt through the uncompressed model, in pieces so that only `piece` rows of logits are held at once."""
    tokenizer = lm.tokenizer
    special, read, offsets = set(tokenizer.all_special_ids), b"", []
    for token in ids:  # where each token's text starts in the decoded prompt (special tokens have none)
        offsets.append(len(read.decode("utf-8", "replace")))
        read += b"" if token in special else token_bytes(tokenizer, token)
    first = TokenLogprob(*_described(tokenizer, ids[0]), None, [], 0)
    out, cache = [first], KVCache(lm.model.config, observe_window=0)
    for s in range(0, len(ids) - 1, piece):
        x = torch.tensor([ids[s:s + piece]], dtype=torch.long, device=lm.model.device)
        logits = lm.model(input_ids=x, cache=cache, use_cache=True).logits[0]
        for j in range(logits.shape[0]):
            i = s + j + 1  # the token these logits predict
            if i < len(ids):
                out.append(token_logprob(tokenizer, logits[j], ids[i], top, offsets[i]))
    return out


def vocab_size(lm: LoadedModel) -> int:
    """How many logits the model gives (its output layer's rows; can be more than the tokenizer's tokens)."""
    return lm.model.get_output_embeddings().weight.shape[0]


# -- logits processors ----------------------------------------------------------------------------------------------
_TOKENIZERS: dict[tuple[int, int], object] = {}


def _ll_tokenizer(lm: LoadedModel, vocab: int, ends: set[int]):
    """llguidance's view of the tokenizer (about 1 s to build: once per model and vocabulary size)."""
    import llguidance.hf

    key = (id(lm.tokenizer), vocab)
    with _lock:
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = llguidance.hf.from_tokenizer(lm.tokenizer, n_vocab=vocab, eos_token=sorted(ends))
        return _TOKENIZERS[key]


def check_grammar(grammar: str) -> str:
    """An llguidance grammar's error message ('' when it compiles)."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)


class Shaper:
    """One choice's logits processors: penalties over its generated tokens, `logit_bias`, and the grammar's mask."""

    def __init__(self, lm: LoadedModel, vocab: int, presence: float = 0.0, frequency: float = 0.0,
                 bias: dict[int, float] | None = None, grammar: str | None = None, ends: set[int] = frozenset()):
        self.presence, self.frequency = presence, frequency
        self.counts = torch.zeros(vocab) if presence or frequency else None
        self.bias_ids = torch.tensor(sorted(bias or {}), dtype=torch.long)
        self.bias_values = torch.tensor([bias[i] for i in sorted(bias or {})], dtype=torch.float32)
        self.matcher = None
        if grammar is not None:
            import llguidance

            self.matcher = llguidance.LLMatcher(_ll_tokenizer(lm, vocab, ends), grammar)
            if self.matcher.is_error():
                raise KVMemError(f"the grammar does not compile: {self.matcher.get_error()}")

    @property
    def active(self) -> bool:
        return self.counts is not None or len(self.bias_ids) > 0 or self.matcher is not None

    def shape(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from (a new tensor; `logits` stays the model's)."""
        scores = logits.float().clone()
        if self.counts is not None:
            scores -= self.frequency * self.counts + self.presence * (self.counts > 0).float()
        if len(self.bias_ids):
            scores[self.bias_ids] += self.bias_values
        if self.matcher is not None:
            allowed = np.frombuffer(self.matcher.compute_logit_bias(), dtype=np.uint8)  # 200 allowed, 0 not
            scores[torch.from_numpy(allowed == 0)] = float("-inf")
        return scores

    def take(self, token: int) -> None:
        if self.counts is not None:
            self.counts[token] += 1
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise KVMemError(f"token {token} left the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar has matched all it can: nothing but an end token may follow."""
        return self.matcher is not None and self.matcher.is_stopped()

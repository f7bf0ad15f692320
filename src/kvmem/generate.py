"""kvmem's own generation loop: prefill, compress, feed more tokens, decode greedily.

`model.generate(..., cache=KVCache(config, compressor=Compressor(...)))` works too (see tests); this
loop exists so that a context can be compressed before a question is read (the query-agnostic,
reusable setting) and so the benchmark can time the parts. Decode-time re-compression is the
Compressor's `every=N`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress import Method, compress, get_method
from kvmem.errors import KVMemError
from kvmem.models import LoadedModel


def new_cache(lm: LoadedModel, method: Method) -> KVCache:
    """A cache that records what `method` needs to score tokens (queries, accumulated attention)."""
    return KVCache(lm.model.config, observe_window=max(64, method.observe_window), track_attention=method.needs_attention)


@torch.no_grad()
def feed(lm: LoadedModel, cache: KVCache, ids: Tensor | list[int]) -> Tensor:
    """Run `ids` through the model on top of `cache`; returns the logits of the last token."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        raise KVMemError("nothing to feed: empty token list")
    if cache.get_seq_length() + ids.shape[1] > lm.max_context:
        raise KVMemError(
            f"context too long: {cache.get_seq_length() + ids.shape[1]} tokens > {lm.max_context} that {lm.name} allows"
        )
    out = lm.model(input_ids=ids.to(lm.model.device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.no_grad()
def nll(lm: LoadedModel, cache: KVCache, ids: list[int]) -> float:
    """Mean negative log-likelihood of `ids[1:]` given the cache and `ids[0]` (for perplexity)."""
    x = torch.tensor([ids], dtype=torch.long)
    logits = lm.model(input_ids=x, cache=cache, use_cache=True).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, x[0, 1:]).item()


_NEWLINE_IDS: dict[int, set[int]] = {}


def end_ids(lm: LoadedModel) -> set[int]:
    eos = lm.model.generation_config.eos_token_id
    return {i for i in set(eos if isinstance(eos, list) else [eos]) | {lm.tokenizer.eos_token_id} if i is not None}


def newline_ids(lm: LoadedModel) -> set[int]:
    """Every token whose text contains a newline (cached per tokenizer)."""
    tok = lm.tokenizer
    if id(tok) not in _NEWLINE_IDS:
        _NEWLINE_IDS[id(tok)] = {i for t, i in tok.get_vocab().items() if "\n" in tok.convert_tokens_to_string([t])}
    return _NEWLINE_IDS[id(tok)]


@torch.no_grad()
def decode(lm: LoadedModel, cache: KVCache, first_logits: Tensor, max_new_tokens: int,
           stop_at_newline: bool = True) -> list[int]:
    """Greedy decoding until end of sequence, `max_new_tokens`, a full context (the model's maximum
    length), or (with `stop_at_newline`) the end of the first line that has any letter or digit."""
    out: list[int] = []
    logits = first_logits
    ends, newlines = end_ids(lm), newline_ids(lm) if stop_at_newline else set()
    for step in range(max_new_tokens):
        token = int(logits.argmax())
        if token in ends:
            break
        if token in newlines and any(c.isalnum() for c in lm.tokenizer.decode(out)):
            break
        out.append(token)
        if step == max_new_tokens - 1 or cache.get_seq_length() >= lm.max_context:
            break  # the model's context is full: nothing more can be generated
        logits = feed(lm, cache, [token])
    return out


@dataclass
class Answer:
    text: str
    tokens: list[int]
    kv_bytes: int
    kv_bytes_full: int
    tokens_held: int


def answer(
    lm: LoadedModel,
    context: str,
    question: str,
    method: str = "full",
    keep_ratio: float = 1.0,
    query_aware: bool = False,
    max_new_tokens: int = 32,
    budget: str = "uniform",
) -> Answer:
    """Read `context`, compress its KV with `method`, then answer `question` (the one-call API).

    query_aware=False compresses the context before the question is seen (the reusable setting);
    True compresses after reading the question too, keeping the question's tokens.
    """
    m = get_method(method)
    tok = lm.tokenizer
    ctx = tok(context, add_special_tokens=True).input_ids
    q = tok(question, add_special_tokens=False).input_ids
    if not q:
        raise KVMemError("the question is empty")
    cache = new_cache(lm, m)
    if not ctx:  # nothing to compress: just answer
        logits = feed(lm, cache, q)
        full_bytes = kept = cache.kv_bytes()
    else:
        feed(lm, cache, ctx + q[:-1] if query_aware else ctx)
        full_bytes = cache.kv_bytes()
        compress(cache, m, keep_ratio, protect_from=len(ctx) if query_aware else None, budget=budget)
        kept = cache.kv_bytes()
        cache.drop_observations()
        logits = feed(lm, cache, q[-1:] if query_aware else q)
    tokens = decode(lm, cache, logits, max_new_tokens)
    return Answer(tok.decode(tokens), tokens, kept, full_bytes, sum(map(sum, cache.tokens_held())))

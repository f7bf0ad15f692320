"""One forward of the model over kvmem caches: `feed` tokens into one cache, `step` a batch of rows, `feed_pieces`
for an interruptible prefill. Below compression, reuse and generation, which all run the model this way."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.models import LoadedModel


@torch.no_grad()
def feed(lm: LoadedModel, cache: KVCache | Cache, ids: Tensor | list[int]) -> Tensor:
    """Run `ids` through the model on top of `cache`; returns the logits of the last token."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        raise KVMemError("nothing to feed: empty token list")
    if cache.get_seq_length() + ids.shape[1] > lm.max_context:
        raise KVMemError(
            f"context too long: {cache.get_seq_length() + ids.shape[1]} tokens > {lm.max_context} that {lm.name} allows"
        )
    ids, positions = ids.to(lm.model.device), None
    if isinstance(cache, KVCache):  # transformers' own caches (the speed benchmark's baseline) take `ids` as they are
        ids, positions = cache.forward_inputs(ids)
    out = lm.model(input_ids=ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.no_grad()
def step(lm: LoadedModel, batch, ids: list[list[int]]) -> Tensor:
    """Feed each row of `batch` (a `kvmem.batch.RowBatch`) its tokens (as many for every row), each at its own
    next position, in one forward; returns the logits of every row's last token, (rows, vocab)."""
    if len(ids) != len(batch) or not batch.caches:
        raise KVMemError(f"{len(ids)} rows of tokens for a batch of {len(batch)} sequences")
    q = len(ids[0])
    if q == 0 or any(len(row) != q for row in ids):
        raise KVMemError("every row of a batched step takes the same number of tokens (at least one)")
    starts = batch.next_positions()
    if max(starts) + q > lm.max_context:
        raise KVMemError(f"context too long: {max(starts) + q} tokens > {lm.max_context} that {lm.name} allows")
    device = lm.model.device
    positions = torch.tensor(starts, device=device)[:, None] + torch.arange(q, device=device)[None]
    x = torch.tensor(ids, dtype=torch.long, device=device)
    return lm.model(input_ids=x, cache=batch, position_ids=positions, use_cache=True, logits_to_keep=1).logits[:, -1]


PIECE = 512  # tokens per forward of an interruptible prefill


def feed_pieces(lm: LoadedModel, cache: KVCache, ids: list[int], interrupt=None) -> Tensor:
    """`feed`, in pieces of `PIECE` tokens with `interrupt()` called before each (it raises to stop) when given;
    one forward otherwise."""
    if interrupt is None:
        return feed(lm, cache, ids)
    for s in range(0, len(ids), PIECE):
        interrupt()
        logits = feed(lm, cache, ids[s:s + PIECE])
    return logits

"""Perplexity of held-out text read through a cache, and Delta-ppl between two caches with a paired block-bootstrap CI
(the quantization and reuse benchmarks' quality measure)."""

from __future__ import annotations

import math

import torch

from kvmem.errors import KVMemError
from kvmem_bench.stats import bootstrap_mean


def ppl_texts(tokenizer, length: int, n: int) -> list[list[int]]:
    """`n` texts of `length` tokens from the end of the shipped abstracts (calibration reads the beginning)."""
    from kvmem.calibration import load_abstracts

    ids = tokenizer("\n\n".join(load_abstracts()), add_special_tokens=False).input_ids
    if len(ids) < n * length + 8192:
        raise KVMemError(f"the shipped text has {len(ids)} tokens: too few for {n} held-out texts of {length}")
    return [ids[len(ids) - (j + 1) * length:len(ids) - j * length] for j in range(n)]


@torch.no_grad()
def token_nlls(lm, cache, ids: list[int], chunk: int) -> list[float]:
    """NLL of ids[1:], fed in chunks of `chunk` tokens on top of `cache` (each chunk reads the cache as left)."""
    x = torch.tensor([ids])
    out: list[float] = []
    for start in range(0, len(ids) - 1, chunk):
        part = x[:, start:start + chunk]
        logits = lm.model(input_ids=part, cache=cache, use_cache=True).logits[0].float()
        targets = x[0, start + 1:start + 1 + part.shape[1]]
        out += torch.nn.functional.cross_entropy(logits[:len(targets)], targets, reduction="none").tolist()
    return out


def delta_ppl(pairs: list[tuple[list[float], list[float]]], block: int) -> tuple[float, float, float]:
    """Delta perplexity in percent of a against base over texts [(nll_a, nll_base), ...], with a 95% paired
    block-bootstrap CI (blocks of `block` consecutive tokens of one text, so correlated neighbours are
    resampled together)."""
    diffs = []
    for a, base in pairs:
        n = min(len(a), len(base))
        diffs += [sum(a[i:min(i + block, n)]) / len(a[i:min(i + block, n)])
                  - sum(base[i:min(i + block, n)]) / len(base[i:min(i + block, n)]) for i in range(0, n, block)]
    est, lo, hi = bootstrap_mean(diffs)
    return tuple(100 * (math.exp(x) - 1) for x in (est, lo, hi))

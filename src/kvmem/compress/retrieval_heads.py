"""Offline probes that find retrieval heads (the `duo` and `razor` budgets), fitted once per model fingerprint
on generated data and cached (`calibration.py`); nothing is downloaded. Scores are per (layer, KV head):
a KV head counts as retrieving when any query head of its group does (its cache serves them all).

* `needle_copy_scores` (for `duo`): a needle (a random code) is hidden in shipped prose, the model is asked
  for it and the code is fed as the answer (teacher forcing). A head retrieves at an answer step when its
  strongest attention falls on the context token being copied (the retrieval score of Wu et al. 2024,
  "Retrieval Head Mechanistically Explains Long-Context Factuality"). DuoAttention (Xiao et al. 2024)
  instead *trains* a gate per head on synthetic passkey retrieval; training is outside kvmem, so `duo`
  ranks heads by this training-free probe on the same kind of data.
* `echo_induction_scores` (for `razor`): RazorAttention's probe (Tang et al. 2024): random tokens repeated
  (the reference uses 2500 random ids x 4; kvmem 500 x 4, so the previous occurrence stays inside
  Gemma-3's 512-token sliding window); an echo head attends to the previous occurrence of the current
  token, an induction head to the token after it. Scores are the mean attention on those positions over
  the repeats.
"""

from __future__ import annotations

import random
import string

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import causal_logits, replay
from kvmem.calibration import calibration_ids, load_or_fit


def retrieval_scores(lm, probe: str) -> dict[str, Tensor]:
    """{"layer.i": (KV heads,)} from the named probe, fitted once and cached."""
    if probe == "needle-copy":
        params = dict(samples=8, length=1500, seed=0)
        return load_or_fit(lm, "needle-copy", params, lambda: needle_copy_scores(lm, **params))
    params = dict(length=500, repeats=4, seed=0)
    return load_or_fit(lm, "echo-induction", params, lambda: echo_induction_scores(lm, **params))


def _group_max(per_query_head: Tensor, n_kv: int) -> Tensor:
    return per_query_head.reshape(n_kv, -1).amax(dim=1)


@torch.no_grad()
def needle_copy_scores(lm, samples: int, length: int, seed: int) -> dict[str, Tensor]:
    from kvmem.forward import feed
    from kvmem.prompts import build_prompt

    rng = random.Random(seed)
    tok = lm.tokenizer
    prose = calibration_ids(tok, samples, length)
    hits: dict[int, Tensor] = {}
    steps = 0
    for ids in prose:
        code = "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(10))
        words = tok.decode(ids).split(" ")
        cut = rng.randrange(len(words) // 10, 9 * len(words) // 10)
        document = " ".join(words[:cut]) + f" The access code is {code}. " + " ".join(words[cut:])
        prompt = build_prompt(tok, document, "What is the access code?", "The access code is",
                              raw=tok.chat_template is None)
        answer = tok(" " + code, add_special_tokens=False).input_ids
        context = prompt.context
        at = next((s for s in range(len(context) - len(answer)) if context[s:s + len(answer)] == answer), -1)
        if at < 0:  # the code tokenized differently inside the prose: no copy target to check
            continue
        where = list(range(at, at + len(answer)))
        cache = KVCache(lm.model.config, observe_window=1)
        feed(lm, cache, prompt.ids[:-1])
        fed = prompt.ids[-1:] + answer[:-1]  # the query at step j predicts answer[j]

        def record(idx, queries, keys, positions, new_pos, scaling):
            groups = queries.shape[0] // len(keys)
            per_q = torch.zeros(queries.shape[0])
            for h, (k, p) in enumerate(zip(keys, positions)):
                logits = causal_logits(queries[h * groups:(h + 1) * groups], k, p, new_pos, scaling)
                top = p[logits.argmax(dim=-1)]  # (group, steps): position each query head looks at most
                per_q[h * groups:(h + 1) * groups] = (top == torch.tensor(where)[None, :]).float().sum(dim=1)
            hits[idx] = hits.get(idx, torch.zeros_like(per_q)) + per_q

        replay(lm, cache, fed, record)
        steps += len(where)
    n_kv = {i: len(layer.lengths()) for i, layer in enumerate(cache.layers)}
    return {f"layer.{i}": _group_max(h / max(steps, 1), n_kv[i]) for i, h in hits.items()}


@torch.no_grad()
def echo_induction_scores(lm, length: int, repeats: int, seed: int) -> dict[str, Tensor]:
    from kvmem.forward import feed

    g = torch.Generator().manual_seed(seed)
    vocab = lm.tokenizer.vocab_size
    block = torch.randint(vocab // 10, vocab // 2, (length,), generator=g).tolist()
    bos = [lm.tokenizer.bos_token_id] if lm.tokenizer.bos_token_id is not None else []
    ids = bos + block * repeats
    cache = KVCache(lm.model.config, observe_window=1)
    feed(lm, cache, ids[:len(bos) + length])  # the first copy; the repeats are probed
    offset = len(bos)
    echo: dict[int, Tensor] = {}
    induction: dict[int, Tensor] = {}

    def record(idx, queries, keys, positions, new_pos, scaling):
        groups = queries.shape[0] // len(keys)
        e, ind = torch.zeros(queries.shape[0]), torch.zeros(queries.shape[0])
        for h, (k, p) in enumerate(zip(keys, positions)):
            logits = causal_logits(queries[h * groups:(h + 1) * groups], k, p, new_pos, scaling)
            att = logits.softmax(dim=-1)
            previous = new_pos - length  # the same token one repeat earlier
            for name, target, out in (("echo", previous, e), ("induction", previous + 1, ind)):
                col = torch.searchsorted(p, target)
                ok = (col < p.numel()) & (p[col.clamp(max=p.numel() - 1)] == target)
                picked = att.gather(2, col.clamp(max=p.numel() - 1)[None, :, None].expand(att.shape[0], -1, 1))[..., 0]
                out[h * groups:(h + 1) * groups] = (picked * ok[None]).sum(dim=1) / ok.sum().clamp_min(1)
        echo[idx], induction[idx] = e, ind

    replay(lm, cache, ids[offset + length:], record)
    n_kv = {i: len(layer.lengths()) for i, layer in enumerate(cache.layers)}
    # a head is a retrieval head by either pattern; each score is a mean attention weight in [0, 1]
    return {f"layer.{i}": _group_max(torch.maximum(echo[i], induction[i]), n_kv[i]) for i in echo}

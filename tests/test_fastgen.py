"""FastGen (Ge et al. 2024): the per-head profile checked against attention maps from transformers' own eager
attention on SmolLM2 (an independent path from kvmem's replay), with the policy sets rebuilt here from the paper's
definitions; each head keeps exactly its policy's tokens; one recovery threshold serves every head and fits the keep
ratio; it keeps other tokens than h2o and streaming-llm; memory is freed; bad options are refused by name."""

from __future__ import annotations

import math
import string

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmem.cache import KVCache
from kvmem.compress import Compressor, ModelContext, compress, get_method
from kvmem.compress.fastgen import POLICIES, policy_at
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.models import cache_dir
from kvmem.prompts import build_prompt

GROUPS = 3  # SmolLM2: 9 query heads share 3 KV heads
LAYERS = (0, 7, 29)
TEXT = ("FastGen profiles each attention head: some look at special tokens, some at punctuation; others read a "
        "local window, or a few frequent tokens. Which one? It depends on the layer, the head, and the prompt! "
        "The policies are nested: special, then punctuation, then frequent tokens, then the local window.") * 2


@pytest.fixture(scope="module")
def prompt(smollm2):
    """A chat-template prompt (so it holds special tokens), its cache after a prefill, and the attention maps of
    transformers' eager attention on the same ids."""
    ids = build_prompt(smollm2.tokenizer, TEXT, "Which policy?").context
    cache = KVCache(smollm2.model.config, observe_window=64, track_attention=True)
    feed(smollm2, cache, ids)
    eager = AutoModelForCausalLM.from_pretrained(cache_dir() / "models" / "smollm2-135m", attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    return ids, cache, [a[0] for a in attentions]


def reference_profile(attn: torch.Tensor, special: torch.Tensor, punct: torch.Tensor, r_f: float = 0.3,
                      r_l: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's hybrid policies on one KV head's attention maps (group, n, n): the level each token enters at
    and the recovery (attention mass kept, mean over queries) of special, +punct, +frequent, +local."""
    a = attn.double().mean(0)  # the KV head serves its group: its queries' mean map
    n = a.shape[0]
    column = a.sum(0)  # cumulative attention of each token over every query
    level = torch.full((n,), 4)
    level[punct], level[special] = 1, 0
    rest = torch.where(level == 4)[0]
    level[rest[column[rest].argsort(descending=True)[:math.ceil(r_f * n)]]] = 2
    w = int(r_l * n)
    level[(level == 4) & (torch.arange(n) >= n - w)] = 3
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    masks = [(level <= j)[None, :].expand(n, n) for j in range(3)]
    masks.append(masks[2] | ((q - k < w) & (k <= q)))  # each query's own local window
    return level, torch.stack([(a * m).sum(1).mean() for m in masks]).float()


def token_classes(tok, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    special = {int(i) for i in tok.all_special_ids} | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    punct = [bool(tok.decode([i]).strip()) and all(c in string.punctuation for c in tok.decode([i]).strip()) for i in ids]
    return torch.tensor([i in special for i in ids]), torch.tensor(punct)


def test_profile_matches_the_policies_on_eager_attention(smollm2, prompt):
    ids, _, attn = prompt
    special, punct = token_classes(smollm2.tokenizer, ids)
    assert special.sum() >= 2 and punct.sum() >= 10  # the prompt exercises both classes
    levels, recovery = get_method("fastgen").profile_prompt(smollm2, ids)
    for layer in LAYERS:
        for h in range(3):
            level, rec = reference_profile(attn[layer][h * GROUPS:(h + 1) * GROUPS], special, punct)
            ours = levels[layer][h]
            assert torch.equal(ours[level != 2], level[level != 2])  # special, punct, local and the rest exactly
            # frequent tokens: the same but for near-ties in cumulative attention at the cut
            assert (ours == 2).sum() == (level == 2).sum() and ((ours == 2) & (level == 2)).sum() >= (level == 2).sum() - 2
            torch.testing.assert_close(recovery[layer][h], rec, atol=3e-3, rtol=0)
            assert (rec.diff() >= -1e-6).all()  # nested policies recover more and more


def test_each_head_keeps_exactly_its_policy_and_one_threshold_fits_the_ratio(smollm2, prompt):
    ids, cache, _ = prompt
    context = ModelContext(smollm2, ids)
    method = get_method("fastgen")
    levels, recovery = method.profile_prompt(smollm2, ids)
    for ratio in (0.3, 0.6):
        work = cache.clone()
        result = compress(work, method, ratio, context=context)
        budget = 90 * math.ceil(ratio * len(ids))
        held = sum(map(sum, work.tokens_held()))
        assert budget - 0.1 * budget <= held <= budget  # whole policies only: a little may stay unused
        assert work.kv_bytes() == result.kv_bytes_after < cache.kv_bytes()
        t = method.profile["threshold"]
        chosen = []
        for i, layer in enumerate(work.layers):
            for h, kept in enumerate(layer.head_positions):
                policy = policy_at(recovery[i][h], t)
                assert method.profile["policies"][i][h] == POLICIES[policy]
                assert kept.tolist() == torch.where(levels[i][h] <= policy)[0].tolist()  # exactly the policy's tokens
                chosen.append(policy)
        assert len(set(chosen)) >= 2  # heads differ: that is the method
        logits = feed(smollm2, work, smollm2.tokenizer(" The", add_special_tokens=False).input_ids)
        assert torch.isfinite(logits).all()


def test_threshold_option_is_the_papers_recovery_ratio(smollm2, prompt):
    ids, cache, _ = prompt
    method = get_method("fastgen:threshold=0.9")
    _, recovery = method.profile_prompt(smollm2, ids)
    work = cache.clone()
    compress(work, method, 0.99, context=ModelContext(smollm2, ids))  # the budget does not bind: T does
    assert method.profile["threshold"] == pytest.approx(0.9)
    for i, layer in enumerate(work.layers):
        for h in range(3):
            p = policy_at(recovery[i][h], 0.9)
            assert p == 4 or recovery[i][h][p] >= 0.9
            assert p == 0 or recovery[i][h][p - 1] < 0.9  # the cheapest policy reaching T
    assert sum(map(sum, work.tokens_held())) < sum(map(sum, cache.tokens_held()))


def kept(cache, spec: str, ratio: float, context=None) -> list[list[list[int]]]:
    work = cache.clone()
    compress(work, get_method(spec), ratio, context=context)
    return [[p.tolist() for p in layer.head_positions] for layer in work.layers]


def test_not_a_sibling_in_disguise(smollm2, prompt):
    ids, cache, _ = prompt
    ours = kept(cache, "fastgen", 0.4, ModelContext(smollm2, ids))
    for sibling in ("h2o", "streaming-llm", "h2o:budget=global"):
        assert ours != kept(cache, sibling, 0.4), sibling
    assert len({len(p) for layer in ours for p in layer}) > 2  # heads keep different numbers of tokens


def test_bad_options_and_layer_by_layer_use_are_refused_by_name(smollm2, prompt):
    for spec, word in (("fastgen:budget=adaptive", "budget"), ("fastgen:budget=uniform", "budget"),
                       ("fastgen:threshold=0", "threshold"), ("fastgen:threshold=1.5", "threshold"),
                       ("fastgen:local=0", "local"), ("fastgen:frequent=2", "frequent"), ("fastgen:window=3", "window")):
        with pytest.raises(KVMemError, match=word):
            get_method(spec)
    with pytest.raises(KVMemError, match="needs the model"):
        Compressor(get_method("fastgen"), 0.5)
    with pytest.raises(KVMemError, match="context=ModelContext"):
        compress(prompt[1].clone(), get_method("fastgen"), 0.5)

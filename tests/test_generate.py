"""Prompts through the chat template, the stop rule, batched answering, and the masked attention path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmem.attention import grouped_attention
from kvmem.cache import KVCache
from kvmem.compress import ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import StopRule, answer_batch, decode
from kvmem.prompts import build_prompt


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_prompt_splits_the_chat_template_before_the_question(name, request):
    lm = request.getfixturevalue(name)
    tok = lm.tokenizer
    p = build_prompt(tok, "The door is red.", "\nWhat colour is the door?", " The door is")
    whole = tok.apply_chat_template([{"role": "user", "content": "The door is red.\n\nWhat colour is the door?"}],
                                    add_generation_prompt=True, tokenize=False) + "The door is"
    assert tok.decode(p.ids) == whole
    assert tok.decode(p.context).endswith("The door is red.\n\n")  # the context stops where the question starts
    assert tok.decode(p.question).startswith("What colour")
    assert p.ids[:2] != [tok.bos_token_id] * 2  # the template's special tokens are not added twice
    empty = build_prompt(tok, "", "Hi?")  # no document: the context is the template's head alone
    head = tok.apply_chat_template([{"role": "user", "content": "Hi?"}], add_generation_prompt=True, tokenize=False)
    assert tok.decode(empty.context) == head[:head.index("Hi?")]


def test_raw_prompts_and_errors(smollm2):
    tok = smollm2.tokenizer
    raw = build_prompt(tok, "Some text.", "\nQuestion?", " Answer:", raw=True)
    assert tok.decode(raw.ids).endswith("Some text.\nQuestion? Answer:")
    with pytest.raises(KVMemError, match="question is empty"):
        build_prompt(tok, "text", "  ")

    class NoTemplate:
        chat_template = None

    with pytest.raises(KVMemError, match="no chat template"):
        build_prompt(NoTemplate(), "text", "q?")


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_instruct_model_answers_through_its_template(name, request):
    lm = request.getfixturevalue(name)
    p = build_prompt(lm.tokenizer, "Mara Velden grew up in Lisbon. Tomas Novak grew up in Oslo.",
                     "In which city did Tomas Novak grow up?", "Tomas Novak grew up in")
    assert lm.tokenizer.chat_template  # an instruct model: its own template, from its GGUF
    cache = KVCache(lm.model.config)
    out = lm.tokenizer.decode(decode(lm, cache, feed(lm, cache, p.ids), 8))
    assert "Oslo" in out


def test_stop_rule(smollm2):
    tok = smollm2.tokenizer
    ids = tok(" 1234567. And more", add_special_tokens=False).input_ids
    newline = tok("\n", add_special_tokens=False).input_ids[0]

    def run(rule, tokens):
        out = []
        for t in tokens:
            if not rule.accept(out, t):
                break
        return tok.decode(out)

    assert run(StopRule(smollm2, 32), ids + [newline] + ids) == " 1234567. And more"  # first line only
    assert run(StopRule(smollm2, 32), [newline] + ids) .startswith("\n")  # a leading newline does not end it
    assert run(StopRule(smollm2, 3), ids) == tok.decode(ids[:3])
    found = run(StopRule(smollm2, 32, answers=["1234567"]), ids)
    assert found.strip().startswith("1234567") and "more" not in found  # stops once the answer is there
    eos = next(iter(StopRule(smollm2, 4).ends))
    assert run(StopRule(smollm2, 32), ids[:2] + [eos] + ids) == tok.decode(ids[:2])


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_batched_answers_equal_one_by_one(name, request):
    """Several differently compressed caches (ragged heads too) answered in one batch give the tokens each
    gives alone, and the caches are left as they were."""
    lm = request.getfixturevalue(name)
    p = build_prompt(lm.tokenizer, open(__file__).read()[:2500] + "\nThe secret word is tangerine.",
                     "What is the secret word?", "The secret word is")
    base = KVCache(lm.model.config, track_attention=True)
    feed(lm, base, p.context)
    caches = []
    for spec, ratio in [("full", 1.0), ("snapkv", 0.5), ("h2o:budget=adaptive", 0.25), ("streaming-llm", 0.1),
                        ("knorm:budget=adaptive", 0.5), ("keydiff:budget=pyramid", 0.25),
                        ("streaming-llm:budget=razor", 0.25)]:  # razor: rows standing for many tokens
        c = base.clone()
        compress(c, get_method(spec), ratio, context=ModelContext(lm, p.context, p.head))
        c.drop_observations()
        caches.append(c)
    held = [c.tokens_held() for c in caches]
    batched = answer_batch(lm, caches, p.question, 12)
    assert [c.tokens_held() for c in caches] == held
    alone = [decode(lm, c, feed(lm, c, p.question), 12) for c in caches]
    assert batched == alone
    assert "tangerine" in lm.tokenizer.decode(batched[0])


def test_grouped_attention_equals_repeated_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
    mask = torch.rand(2, 3, 5, 11) > 0.3
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=mask.repeat_interleave(2, 1), scale=0.3).transpose(1, 2)
    torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.3), expected)


def test_long_sliding_window_forwards_attend_block_by_block_as_the_full_mask_does(tiny_gemma, monkeypatch):
    """A long forward of a sliding-window layer attends each block of queries over its window only (not the
    model's whole (Q, T) mask): the same logits as SDPA with that mask, in one forward or in chunks; a padded
    mask is not the plain window mask and keeps SDPA."""
    import kvmem.attention as attention

    monkeypatch.setattr(attention, "WINDOW_BLOCK", 4)  # tiny_gemma's window is 8: blocks of 4 queries
    ids = torch.randint(0, 128, (1, 61), generator=torch.Generator().manual_seed(3))
    taken = []
    check = attention.standard_window_mask
    monkeypatch.setattr(attention, "standard_window_mask", lambda *a: taken.append(check(*a)) or taken[-1])

    def logits(pieces: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        cache = KVCache(tiny_gemma.config)
        with torch.no_grad():
            if mask is not None:
                return tiny_gemma(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits
            return torch.cat([tiny_gemma(input_ids=p, cache=cache, use_cache=True).logits for p in ids.chunk(pieces, 1)], 1)

    windowed, chunked = logits(1), logits(3)
    assert taken and all(taken)  # every sliding layer of every forward took the windowed path
    taken.clear()
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 10**6)  # never: SDPA with the model's mask
    reference = logits(1)
    assert not taken
    torch.testing.assert_close(windowed, reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, reference, atol=1e-5, rtol=0)
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 4)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0  # left padding: not the plain window mask
    logits(1, padded)
    assert taken and not any(taken)


@pytest.mark.parametrize("aware", [False, True])
def test_every_method_handles_a_tiny_context(smollm2, aware):
    """A 3-word document is shorter than every observation window: each method still compresses and answers."""
    from kvmem.compress import METHODS
    from kvmem.generate import answer

    for method in METHODS:
        a = answer(smollm2, "Rome is red.", "What is red?", method, 1.0 if method == "full" else 0.25,
                   query_aware=aware, max_new_tokens=4)
        assert a.tokens and a.kv_bytes <= a.kv_bytes_full

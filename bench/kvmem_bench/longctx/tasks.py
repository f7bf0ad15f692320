"""RULER-style long-context benchmark samples, QA over real text, and perplexity text.

The synthetic tasks follow RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"); everything is generated offline and deterministically from a seed:

- `niah-single-number` / `-word` / `-uuid`: one "special magic" needle hidden in a haystack of paper
  abstracts (RULER's S-NIAH-2 and -3, with abstracts for essays); `niah-single-noise`: the number needle in
  repeated noise sentences (RULER's S-NIAH-1); `niah-multikey` (4 keys, ask one), `niah-multivalue` (one key, 4 values, ask all),
  `niah-multiquery` (4 keys, ask all).
- `passkey`: the classic pass key hidden in repeated noise ("The grass is green. ...").
- `variable-tracking`: follow a chain of `VAR X = VAR Y.` assignments, with a distractor chain.
- `common-words`: name the 10 most frequent words of a long numbered word list.
- `qa-abstracts`: name the method proposed in one abstract among many real abstracts.

Tasks over real prose (the abstracts, not repeated filler), with facts about invented people:

- `fact-single`: one inserted fact ("Mara Velden grew up in Lisbon."), asked for.
- `fact-distractors`: five facts of the same kind about five people; one is asked for.
- `two-hop`: fact A names the person who leads a project, fact B gives that person's office; the
  question asks for the office starting from the project (plus a distractor pair of the same shape).
- `qa-cloze`: one abstract's sentence is quoted with the proposed method's name blanked out; the model
  finds the abstract among the others and names the method.

`perplexity_text` cuts token sequences from the same abstracts for recall / next-text perplexity.
The haystack text is `kvmem/data/abstracts.txt` (one abstract per line, `kvmem.calibration.load_abstracts`), shipped with the package.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from kvmem.calibration import load_abstracts
from kvmem.errors import KVMemError
from kvmem.generate import normalize_text
from kvmem_bench.longctx.facts import fact_distractors, fact_profile, fact_single, qa_cloze, two_hop
from kvmem_bench.longctx.haystack import Sample, random_number
from kvmem_bench.longctx.ruler import (common_words, niah_multikey, niah_multiquery, niah_multivalue, niah_single, passkey,
                                       qa_abstracts, uuid_value, variable_tracking, word_value)

MIN_CONTEXT_TOKENS = {"common-words": 768, "qa-abstracts": 1024, "qa-cloze": 1024}
DEFAULT_MIN_CONTEXT_TOKENS = 256

TASKS: dict[str, Callable[[random.Random, object, int], Sample]] = {
    "niah-single-number": niah_single("niah-single-number", "number", lambda rng, key: random_number(rng), 16),
    "niah-single-noise": niah_single("niah-single-noise", "number", lambda rng, key: random_number(rng), 16, noise=True),
    "niah-single-word": niah_single("niah-single-word", "word", word_value, 16),
    "niah-single-uuid": niah_single("niah-single-uuid", "uuid", uuid_value, 48),
    "niah-multikey": niah_multikey,
    "niah-multivalue": niah_multivalue,
    "niah-multiquery": niah_multiquery,
    "passkey": passkey,
    "variable-tracking": variable_tracking,
    "common-words": common_words,
    "qa-abstracts": qa_abstracts,
    "fact-single": fact_single,
    "fact-distractors": fact_distractors,
    "fact-profile": fact_profile,
    "two-hop": two_hop,
    "qa-cloze": qa_cloze,
}


def make_samples(task: str, tokenizer, context_tokens: int, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `task` whose context+question+answer_prefix is 90-100% of `context_tokens` tokens.

    Sample i depends only on (task, seed, i, context_tokens, tokenizer), not on `n`."""
    if task not in TASKS:
        raise KVMemError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    minimum = MIN_CONTEXT_TOKENS.get(task, DEFAULT_MIN_CONTEXT_TOKENS)
    if context_tokens < minimum:
        raise KVMemError(f"task {task!r} needs context_tokens >= {minimum} (got {context_tokens})")
    if n < 0:
        raise KVMemError(f"n must be >= 0 (got {n})")
    return [TASKS[task](random.Random(f"{task}:{seed}:{i}"), tokenizer, context_tokens) for i in range(n)]


def score_output(answers: Sequence[str], output: str) -> float:
    """Fraction of `answers` found in `output` (case-insensitive, whitespace-normalized)."""
    if not answers:
        return 0.0
    out = normalize_text(output)
    return sum(normalize_text(a) in out for a in answers) / len(answers)


def score(sample: Sample, output: str) -> float:
    """Fraction of `sample.answers` found in `output` (RULER's string match)."""
    return score_output(sample.answers, output)


def perplexity_text(tokenizer, context_tokens: int, continuation_tokens: int, n: int, seed: int = 0,
                    kind: str = "recall") -> list[tuple[list[int], list[int]]]:
    """`n` (context_ids, continuation_ids) pairs cut from shuffled abstracts joined by blank lines.

    kind="recall": the continuation repeats the context from the "\\n\\n" before an abstract that starts
    in the first half (a model with the whole cache can copy it). kind="next": the continuation is the
    abstracts that follow the context (none of them is in it). Token ids carry no special tokens."""
    if kind not in ("recall", "next"):
        raise KVMemError(f"unknown perplexity kind {kind!r}; use 'recall' or 'next'")
    if context_tokens < 1 or continuation_tokens < 1 or n < 0:
        raise KVMemError("context_tokens and continuation_tokens must be >= 1 and n >= 0")
    if kind == "recall" and continuation_tokens > context_tokens // 2:
        raise KVMemError("recall needs continuation_tokens <= context_tokens // 2")
    abstracts = load_abstracts()
    first = tokenizer(list(abstracts), add_special_tokens=False).input_ids
    later = tokenizer(["\n\n" + a for a in abstracts], add_special_tokens=False).input_ids
    out = []
    for i in range(n):
        rng = random.Random(f"perplexity:{seed}:{i}")
        order = list(range(len(abstracts)))
        rng.shuffle(order)
        ids: list[int] = []
        starts: list[int] = []
        for j, a in enumerate(order):
            starts.append(len(ids))
            ids += later[a] if j else first[a]
            after = next((s for s in starts if s >= context_tokens), len(ids))
            if len(ids) >= context_tokens and (kind == "recall" or len(ids) - after >= continuation_tokens):
                break
        else:
            raise KVMemError(f"perplexity_text: the abstracts hold only {len(ids)} tokens, too few for "
                             f"context_tokens={context_tokens} plus the continuation")
        context = ids[:context_tokens]
        if kind == "next":
            out.append((context, ids[after:after + continuation_tokens]))
            continue
        half = context_tokens // 2
        valid = [s for j, s in enumerate(starts) if j and s + min(len(later[order[j]]), continuation_tokens) <= half]
        if not valid:
            raise KVMemError(f"perplexity_text: context_tokens={context_tokens} is too short for recall")
        start = rng.choice(valid)
        out.append((context, ids[start:start + continuation_tokens]))
    return out

"""The RULER-style synthetic tasks (Hsieh et al. 2024): needles in haystacks, pass key, variable tracking, common
words; and `qa-abstracts`, naming the method one real abstract proposes."""

from __future__ import annotations

import random
import re
import uuid
from functools import lru_cache
from typing import Callable, Sequence

from kvmem.calibration import load_abstracts
from kvmem_bench.longctx.haystack import (ADJECTIVES, NOUNS, Sample, Unit, abstract_stream, corpus_words, distinct, fit_to_length, needle_depths, needle_sample, plain_nouns, random_key, random_number, take_words)


def _niah_preamble(kind: str) -> str:
    return (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n\n")


def niah_single(task: str, label: str, value: Callable[[random.Random, str], str], max_new: int, noise: bool = False):
    def generate(rng: random.Random, tokenizer, target: int) -> Sample:
        key = random_key(rng)
        val = value(rng, key)
        needle = f"One of the special magic {label}s for {key} is: {val}."
        question = f"\nWhat is the special magic {label} for {key} mentioned in the provided text?"
        prefix = f" The special magic {label} for {key} mentioned in the provided text is"
        return needle_sample(task, rng, tokenizer, target, list(zip(needle_depths(rng, 1), [needle])), question,
                              prefix, [val], max_new, _niah_preamble(f"{label}s"), noise=noise)

    generate.__doc__ = f"RULER single needle; the value is a {label}" + (", the haystack repeated noise." if noise else ".")
    return generate


def word_value(rng: random.Random, key: str) -> str:
    return rng.choice([w for w in plain_nouns() if w not in key.split("-")])


def uuid_value(rng: random.Random, key: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def niah_multikey(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with different keys; ask for one of them."""
    keys, nums = distinct(lambda: random_key(rng), 4), distinct(lambda: random_number(rng), 4)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, nums)]
    q = rng.randrange(4)
    return needle_sample(
        "niah-multikey", rng, tokenizer, target, list(zip(needle_depths(rng, 4), needles)),
        f"\nWhat is the special magic number for {keys[q]} mentioned in the provided text?",
        f" The special magic number for {keys[q]} mentioned in the provided text is",
        [nums[q]], 16, _niah_preamble("numbers"))


def niah_multivalue(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with the same key and different numbers; ask for all of them."""
    key, nums = random_key(rng), distinct(lambda: random_number(rng), 4)
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in nums]
    return needle_sample(
        "niah-multivalue", rng, tokenizer, target, list(zip(needle_depths(rng, 4), needles)),
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?",
        f" The special magic numbers for {key} mentioned in the provided text are",
        nums, 64, _niah_preamble("numbers"))


def niah_multiquery(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with different keys; ask for all four numbers."""
    keys, nums = distinct(lambda: random_key(rng), 4), distinct(lambda: random_number(rng), 4)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, nums)]
    listed = f"{', '.join(keys[:3])}, and {keys[3]}"
    return needle_sample(
        "niah-multiquery", rng, tokenizer, target, list(zip(needle_depths(rng, 4), needles)),
        f"\nWhat are all the special magic numbers for {listed} mentioned in the provided text?",
        f" The special magic numbers for {listed} mentioned in the provided text are",
        nums, 64, _niah_preamble("numbers"))


def passkey(rng: random.Random, tokenizer, target: int) -> Sample:
    """The pass key hidden in repeated noise sentences."""
    key = random_number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    preamble = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.\n\n")
    return needle_sample("passkey", rng, tokenizer, target, list(zip(needle_depths(rng, 1), [needle])),
                          "\nWhat is the pass key?", " The pass key is", [key], 16, preamble, noise=True)


def variable_tracking(rng: random.Random, tokenizer, target: int) -> Sample:
    """A chain of 4 variables holding one value, plus a distractor chain with another value."""
    text = "\n".join(load_abstracts())
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = distinct(lambda: "".join(rng.choice(letters) for _ in range(5)), 8)
    while any(n in text for n in names):  # practically never: keep names absent from the filler
        names = distinct(lambda: "".join(rng.choice(letters) for _ in range(5)), 8)
    value, other = distinct(lambda: random_number(rng, 5), 2)
    needles: list[tuple[float, str]] = []
    for chain, val in ((names[:4], value), (names[4:], other)):
        statements = [f"VAR {chain[0]} = {val}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        needles += zip(sorted(needle_depths(rng, 4)), statements)
    return needle_sample(
        "variable-tracking", rng, tokenizer, target, needles,
        f"\nFind all variables that are assigned the value {value} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"4 variables are assigned the value {value}, they are:",
        names[:4], 40, "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")


def common_words(rng: random.Random, tokenizer, target: int) -> Sample:
    """A numbered word list where 10 words appear 10-30 times each and the rest at most 3 times."""
    common = rng.sample(plain_nouns(), 10)
    freq = min(30, max(10, target // 100))
    rare = sorted(corpus_words() - set(common) - set(NOUNS) - set(ADJECTIVES))
    rare = [w for w in rare if 4 <= len(w) <= 12]
    rng.shuffle(rare)
    items = [w for w in rare for _ in range(rng.randint(1, 3))]
    shuffle_seed = rng.getrandbits(64)
    preamble = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n")
    question = "\nWhat are the 10 most common words in the above list?"
    prefix = " Answer: The top 10 words that appear most often in the list are:"

    def build(k: int) -> tuple[str, str, str]:
        words = common * freq + items[:k]
        random.Random(shuffle_seed).shuffle(words)
        return preamble + " ".join(f"{i}. {w}" for i, w in enumerate(words, 1)), question, prefix

    context, _, _ = fit_to_length(tokenizer, build, target, len(items), 6.0, "common-words")
    return Sample("common-words", context, question, prefix, tuple(common), 80)


_VERB = re.compile(r"\b(?:we|this (?:paper|work))\s+(?:propose|introduce|present|develop|design)s?\s+"
                   r"(?:(?:the|a|an)\s+)?", re.I)
_CALLED = re.compile(r"\b(?:called|named|dubbed|termed)\s+(?:(?:the|a|an)\s+)?(\S+)", re.I)
_PAREN = re.compile(r"\(([^()\s]+)\)")


def _distinctive(word: str) -> bool:
    """A name like EMAT, KVQuant, Q-Filters, 2DMSE: a digit, or an inner/all-caps capital in a part."""
    if not re.fullmatch(r"[A-Za-z0-9][\w\-+.]*[A-Za-z0-9+]", word) or not re.search(r"[A-Za-z]", word):
        return False
    parts = [p for p in word.split("-") if p]
    return any(c.isdigit() for c in word) or any(p.isupper() or any(c.isupper() for c in p[1:]) for p in parts)


def _proposed_name(abstract: str) -> str | None:
    """The name after "we propose/introduce/present ..." (directly, after "called", or in parentheses)."""
    clean = lambda w: w.strip(".,;:!?\"'{}[]()")  # noqa: E731
    for m in _VERB.finditer(abstract):
        sentence = re.split(r"(?<=[.!?])\s", abstract[m.end():], maxsplit=1)[0]
        words = sentence.split()
        called = _CALLED.search(sentence)
        paren = _PAREN.search(" ".join(words[:12]))
        for found in (words[0] if words else "", called and called.group(1), paren and paren.group(1)):
            if found and _distinctive(clean(found)):
                return clean(found)
    return None


def name_pattern(name: str) -> re.Pattern:
    return re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])", re.I)


@lru_cache(maxsize=1)
def qa_candidates() -> tuple[tuple[int, str], ...]:
    """(abstract index, proposed name) pairs usable as QA targets. The name has at least 4 characters
    and is not inside a longer corpus word (scoring is by substring: "TP" is in "output", "PROP" in
    "propose"); it is rare (at most 2 other abstracts, kept out of the context) and not in the first
    12 words of its abstract (the question quotes them)."""
    abstracts = load_abstracts()
    lowered = [a.lower() for a in abstracts]
    words = set(re.findall(r"[a-z0-9]+", "\n".join(lowered)))
    out = []
    for i, text in enumerate(abstracts):
        name = _proposed_name(text)
        if name is None or len(name) < 4 or any(name.lower() in w and name.lower() != w for w in words):
            continue
        pattern = name_pattern(name)
        others = sum(1 for j, other in enumerate(lowered) if j != i and name.lower() in other and pattern.search(other))
        if others <= 2 and not pattern.search(" ".join(text.split()[:12])):
            out.append((i, name))
    return tuple(out)


def paragraphs_with(units: Sequence[Unit], n_words: int, inserted: str, depth: float) -> list[str]:
    """The first `n_words` words of `units` as paragraphs (one per abstract), with `inserted` at `depth`."""
    paragraphs: list[list[str]] = []
    last = None
    for para, sentence in take_words(units, n_words):
        if para != last:
            paragraphs.append([])
            last = para
        paragraphs[-1].append(sentence)
    texts = [" ".join(p) for p in paragraphs]
    texts.insert(round(depth * len(texts)), inserted)
    return texts


def qa_abstracts(rng: random.Random, tokenizer, target: int) -> Sample:
    """Name the method proposed in one abstract hidden among many others."""
    abstracts = load_abstracts()
    index, name = rng.choice([c for c in qa_candidates() if len(abstracts[c[0]]) <= 2 * target])
    pattern = name_pattern(name)
    pool = [i for i, text in enumerate(abstracts) if i != index and not pattern.search(text)]
    units = abstract_stream(rng, 10**9, pool=pool, repeat=False)  # every other abstract once, shuffled
    depth = rng.uniform(0.05, 0.95)
    opening = " ".join(abstracts[index].split()[:12])
    question = (f"\nIn the abstract that begins \"{opening}\", what is the name of the method or system "
                "the authors propose?")
    prefix = " The authors propose"
    preamble = "Below are abstracts of research papers. Read them carefully; a question follows.\n\n"

    def build(k: int) -> tuple[str, str, str]:
        texts = paragraphs_with(units, k, abstracts[index], depth)
        body = "\n\n".join(f"Abstract {i}: {t}" for i, t in enumerate(texts, 1))
        return preamble + body, question, prefix

    n_words = sum(len(s.split()) for _, s in units)
    context, _, _ = fit_to_length(tokenizer, build, target, n_words, 1.4, "qa-abstracts")
    return Sample("qa-abstracts", context, question, prefix, (name,), 24)

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
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from kvmem.calibration import load_abstracts
from kvmem.errors import KVMemError
from kvmem.generate import normalize_text

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
ADJECTIVES = tuple("""
ancient angry bitter bold brave bright broad brown calm cheap clean clever cloudy cold cool crisp
cruel curly damp dark dizzy dry dusty eager early empty fancy fierce flat fluffy fresh friendly
fuzzy gentle giant glad golden grumpy happy heavy hollow honest huge humble icy jolly keen lazy
little lively lonely loud lucky magic mellow messy mighty muddy narrow noisy odd orange pale
patient plain polite proud purple quick quiet rapid rare rich rough round royal rusty sad salty
sharp shiny shy silent silly slim slow smooth soft sour spicy steep sticky stormy strange sunny
sweet swift tall tame tender thick thin tidy tiny wacky warm wet wild windy wise witty young
""".split())
NOUNS = tuple("""
anchor apple badger bakery balloon banana barn basket beach beaver bicycle blanket bottle bridge
bucket butter cabin camel candle canoe carrot castle cherry chimney cloud cobra comet cookie
cottage cousin crayon dolphin donkey dragon drum eagle falcon feather ferry fiddle garden garlic
giraffe glove goose guitar hammer harbor helmet honey island jacket jungle kettle kitten ladder
lantern lemon lizard lobster meadow mirror monkey mountain muffin napkin needle nest ocean olive
onion orchard otter owl paddle parrot peach pebble pencil pepper piano pillow pirate potato
puppy rabbit raven ribbon river robin rocket saddle sailor salmon shovel squirrel sugar teapot
tiger tomato tractor trumpet tulip turtle umbrella valley violin wagon walrus whistle window wizard
""".split())
MIN_CONTEXT_TOKENS = {"common-words": 768, "qa-abstracts": 1024, "qa-cloze": 1024}
DEFAULT_MIN_CONTEXT_TOKENS = 256


@dataclass(frozen=True)
class Sample:
    """One prompt: `context + question + answer_prefix` is fed to the model, which continues it."""

    task: str
    context: str  # the long document; the part that gets compressed
    question: str  # appended right after the context (starts with "\n"), includes the instruction
    answer_prefix: str  # appended after the question; the model continues from here
    answers: tuple[str, ...]  # every string the model should produce; score = fraction found
    max_new_tokens: int  # enough greedy tokens to produce all answers

    @property
    def one_line(self) -> bool:
        """Whether the answer ends with its first line: one answer does; a list may run over several."""
        return len(self.answers) == 1


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@lru_cache(maxsize=1)
def _sentences() -> tuple[tuple[str, ...], ...]:
    """Each abstract split into sentences."""
    split = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\"])")
    return tuple(tuple(split.split(a)) for a in load_abstracts())


@lru_cache(maxsize=1)
def _corpus_words() -> frozenset[str]:
    return frozenset(re.findall(r"[a-z]+", "\n".join(load_abstracts()).lower()))


@lru_cache(maxsize=1)
def _plain_nouns() -> tuple[str, ...]:
    """Built-in nouns that never occur in the abstracts (safe needle values and common words)."""
    return tuple(w for w in NOUNS if w not in _corpus_words())


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _distinct(make: Callable[[], str], k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        value = make()
        if value not in out:
            out.append(value)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _fit(tokenizer, build: Callable[[int], tuple[str, str, str]], target: int, max_units: int,
         rate: float, task: str) -> tuple[str, str, str]:
    """Largest k (found by interpolation, then bisection) whose build(k) is at most `target` tokens."""

    def size(k: int) -> int:
        return _count(tokenizer, "".join(build(k)))

    lo, lo_n = 0, size(0)
    if lo_n > target:
        raise KVMemError(f"task {task!r}: context_tokens={target} is too small (needs > {lo_n})")
    hi = max_units + 1  # smallest k known not to fit (or past the end)
    for step in range(60):
        if hi - lo <= 1 or lo_n >= 0.98 * target:
            break
        k = lo + max(1, int((0.99 * target - lo_n) / rate)) if step < 8 else (lo + hi) // 2
        k = min(k, hi - 1)
        n = size(k)
        rate = max((n - lo_n) / (k - lo), 0.05)
        if n <= target:
            lo, lo_n = k, n
        else:
            hi = k
    if lo_n < 0.9 * target:
        raise KVMemError(f"task {task!r}: could only fill {lo_n} of context_tokens={target} "
                         "(not enough filler text for this length)")
    return build(lo)


# --- haystacks -------------------------------------------------------------------------------

Unit = tuple[int, str]  # (paragraph id, sentence)


def _abstract_stream(rng: random.Random, min_words: int, pool: Sequence[int] | None = None,
                     repeat: bool = True) -> list[Unit]:
    """Sentences of the abstracts in a shuffled order (reshuffled and repeated if `repeat`)."""
    pool = list(range(len(load_abstracts()))) if pool is None else list(pool)
    units: list[Unit] = []
    words, para = 0, 0
    while words < min_words and (repeat or para == 0):
        order = pool[:]
        rng.shuffle(order)
        for i in order:
            units += [(para, s) for s in _sentences()[i]]
            words += len(load_abstracts()[i].split())
            para += 1
            if words >= min_words:
                break
    return units


def _noise_stream(min_words: int) -> list[Unit]:
    words_per_round = sum(len(s.split()) for s in NOISE)
    return [(0, s) for _ in range(min_words // words_per_round + 1) for s in NOISE]


def _take_words(units: Sequence[Unit], n_words: int) -> list[Unit]:
    """The first `n_words` words of `units`, cutting the last sentence if needed."""
    out: list[Unit] = []
    for para, sentence in units:
        if n_words <= 0:
            break
        words = sentence.split()
        out.append((para, sentence if len(words) <= n_words else " ".join(words[:n_words])))
        n_words -= len(words)
    return out


def _render(units: Sequence[Unit], needles: Sequence[tuple[float, str]]) -> str:
    """Join sentences (paragraphs split by blank lines), inserting each needle at its depth."""
    slots: dict[int, list[str]] = {}
    for depth, text in sorted(needles, key=lambda d: d[0]):  # stable: equal depths keep their order
        slots.setdefault(round(depth * len(units)), []).append(text)
    items: list[Unit] = []
    for i in range(len(units) + 1):
        para = units[max(i - 1, 0)][0] if units else 0
        items += [(para, text) for text in slots.get(i, [])]
        if i < len(units):
            items.append(units[i])
    parts: list[str] = []
    for j, (para, text) in enumerate(items):
        if j:
            parts.append(" " if para == items[j - 1][0] else "\n\n")
        parts.append(text)
    return "".join(parts)


def _needle_sample(task: str, rng: random.Random, tokenizer, target: int, needles: Sequence[tuple[float, str]],
                   question: str, prefix: str, answers: Sequence[str], max_new: int, preamble: str,
                   noise: bool = False) -> Sample:
    units = _noise_stream(target + 100) if noise else _abstract_stream(rng, target + 100)
    n_words = sum(len(s.split()) for _, s in units)

    def build(k: int) -> tuple[str, str, str]:
        return preamble + _render(_take_words(units, k), needles), question, prefix

    context, _, _ = _fit(tokenizer, build, target, n_words, 1.4, task)
    return Sample(task, context, question, prefix, tuple(answers), max_new)


def _depths(rng: random.Random, k: int) -> list[float]:
    return [rng.uniform(0.05, 0.95) for _ in range(k)]


# --- tasks -----------------------------------------------------------------------------------

def _niah_preamble(kind: str) -> str:
    return (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n\n")


def _niah_single(task: str, label: str, value: Callable[[random.Random, str], str], max_new: int, noise: bool = False):
    def generate(rng: random.Random, tokenizer, target: int) -> Sample:
        key = _key(rng)
        val = value(rng, key)
        needle = f"One of the special magic {label}s for {key} is: {val}."
        question = f"\nWhat is the special magic {label} for {key} mentioned in the provided text?"
        prefix = f" The special magic {label} for {key} mentioned in the provided text is"
        return _needle_sample(task, rng, tokenizer, target, list(zip(_depths(rng, 1), [needle])), question,
                              prefix, [val], max_new, _niah_preamble(f"{label}s"), noise=noise)

    generate.__doc__ = f"RULER single needle; the value is a {label}" + (", the haystack repeated noise." if noise else ".")
    return generate


def _word_value(rng: random.Random, key: str) -> str:
    return rng.choice([w for w in _plain_nouns() if w not in key.split("-")])


def _uuid_value(rng: random.Random, key: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def niah_multikey(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with different keys; ask for one of them."""
    keys, nums = _distinct(lambda: _key(rng), 4), _distinct(lambda: _number(rng), 4)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, nums)]
    q = rng.randrange(4)
    return _needle_sample(
        "niah-multikey", rng, tokenizer, target, list(zip(_depths(rng, 4), needles)),
        f"\nWhat is the special magic number for {keys[q]} mentioned in the provided text?",
        f" The special magic number for {keys[q]} mentioned in the provided text is",
        [nums[q]], 16, _niah_preamble("numbers"))


def niah_multivalue(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with the same key and different numbers; ask for all of them."""
    key, nums = _key(rng), _distinct(lambda: _number(rng), 4)
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in nums]
    return _needle_sample(
        "niah-multivalue", rng, tokenizer, target, list(zip(_depths(rng, 4), needles)),
        f"\nWhat are all the special magic numbers for {key} mentioned in the provided text?",
        f" The special magic numbers for {key} mentioned in the provided text are",
        nums, 64, _niah_preamble("numbers"))


def niah_multiquery(rng: random.Random, tokenizer, target: int) -> Sample:
    """Four needles with different keys; ask for all four numbers."""
    keys, nums = _distinct(lambda: _key(rng), 4), _distinct(lambda: _number(rng), 4)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, nums)]
    listed = f"{', '.join(keys[:3])}, and {keys[3]}"
    return _needle_sample(
        "niah-multiquery", rng, tokenizer, target, list(zip(_depths(rng, 4), needles)),
        f"\nWhat are all the special magic numbers for {listed} mentioned in the provided text?",
        f" The special magic numbers for {listed} mentioned in the provided text are",
        nums, 64, _niah_preamble("numbers"))


def passkey(rng: random.Random, tokenizer, target: int) -> Sample:
    """The pass key hidden in repeated noise sentences."""
    key = _number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    preamble = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.\n\n")
    return _needle_sample("passkey", rng, tokenizer, target, list(zip(_depths(rng, 1), [needle])),
                          "\nWhat is the pass key?", " The pass key is", [key], 16, preamble, noise=True)


def variable_tracking(rng: random.Random, tokenizer, target: int) -> Sample:
    """A chain of 4 variables holding one value, plus a distractor chain with another value."""
    text = "\n".join(load_abstracts())
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names = _distinct(lambda: "".join(rng.choice(letters) for _ in range(5)), 8)
    while any(n in text for n in names):  # practically never: keep names absent from the filler
        names = _distinct(lambda: "".join(rng.choice(letters) for _ in range(5)), 8)
    value, other = _distinct(lambda: _number(rng, 5), 2)
    needles: list[tuple[float, str]] = []
    for chain, val in ((names[:4], value), (names[4:], other)):
        statements = [f"VAR {chain[0]} = {val}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        needles += zip(sorted(_depths(rng, 4)), statements)
    return _needle_sample(
        "variable-tracking", rng, tokenizer, target, needles,
        f"\nFind all variables that are assigned the value {value} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"4 variables are assigned the value {value}, they are:",
        names[:4], 40, "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")


def common_words(rng: random.Random, tokenizer, target: int) -> Sample:
    """A numbered word list where 10 words appear 10-30 times each and the rest at most 3 times."""
    common = rng.sample(_plain_nouns(), 10)
    freq = min(30, max(10, target // 100))
    rare = sorted(_corpus_words() - set(common) - set(NOUNS) - set(ADJECTIVES))
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

    context, _, _ = _fit(tokenizer, build, target, len(items), 6.0, "common-words")
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


def _name_pattern(name: str) -> re.Pattern:
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
        pattern = _name_pattern(name)
        others = sum(1 for j, other in enumerate(lowered) if j != i and name.lower() in other and pattern.search(other))
        if others <= 2 and not pattern.search(" ".join(text.split()[:12])):
            out.append((i, name))
    return tuple(out)


def _paragraphs_with(units: Sequence[Unit], n_words: int, inserted: str, depth: float) -> list[str]:
    """The first `n_words` words of `units` as paragraphs (one per abstract), with `inserted` at `depth`."""
    paragraphs: list[list[str]] = []
    last = None
    for para, sentence in _take_words(units, n_words):
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
    pattern = _name_pattern(name)
    pool = [i for i, text in enumerate(abstracts) if i != index and not pattern.search(text)]
    units = _abstract_stream(rng, 10**9, pool=pool, repeat=False)  # every other abstract once, shuffled
    depth = rng.uniform(0.05, 0.95)
    opening = " ".join(abstracts[index].split()[:12])
    question = (f"\nIn the abstract that begins \"{opening}\", what is the name of the method or system "
                "the authors propose?")
    prefix = " The authors propose"
    preamble = "Below are abstracts of research papers. Read them carefully; a question follows.\n\n"

    def build(k: int) -> tuple[str, str, str]:
        texts = _paragraphs_with(units, k, abstracts[index], depth)
        body = "\n\n".join(f"Abstract {i}: {t}" for i, t in enumerate(texts, 1))
        return preamble + body, question, prefix

    n_words = sum(len(s.split()) for _, s in units)
    context, _, _ = _fit(tokenizer, build, target, n_words, 1.4, "qa-abstracts")
    return Sample("qa-abstracts", context, question, prefix, (name,), 24)


# --- facts about invented people, hidden in real prose ---------------------------------------------

FIRST_NAMES = tuple("""
Mara Tomas Ilse Jonah Priya Kenji Sofia Emeka Lena Rafael Yusuf Greta Anika Mateo Nadia Oskar Leila Viktor
Hana Felix Ingrid Amara Bruno Celia Dario Elif Farid Gisela Hugo Irene Jasper Kalinda Lorenzo Mirela Nils
""".split())
LAST_NAMES = tuple("""
Velden Okafor Lindqvist Moreau Castellan Brandt Novak Haddad Ferreira Kowalski Tanaka Oyelaran Duchamp
Silvestri Marsh Albrecht Renner Quintero Halvorsen Ibarra Jansen Koval Lacroix Mbeki Nakamura Ostrowski
""".split())
CITIES = tuple("""
Lisbon Oslo Nairobi Quito Tbilisi Valencia Krakow Osaka Dakar Porto Hanoi Bergen Cusco Tallinn Seville
Adelaide Bremen Lyon Zagreb Montevideo Marrakesh Reykjavik Helsinki Antwerp Bologna Cordoba Edinburgh
""".split())  # none of these names occurs in the abstracts (checked in tests)


@dataclass(frozen=True)
class Attribute:
    """A kind of fact about a person: how it is stated, asked and answered."""

    fact: str  # "{p}" is the person, "{v}" the value
    question: str
    prefix: str
    value: Callable[[random.Random], str]


ATTRIBUTES = {
    "room": Attribute("{p}'s office is in room {v}.", "In which room is {p}'s office?", "{p}'s office is in room",
                      lambda rng: str(rng.randint(100, 9999))),
    "city": Attribute("{p} grew up in {v}.", "In which city did {p} grow up?", "{p} grew up in",
                      lambda rng: rng.choice(CITIES)),
    # Years of the 1900s: the abstracts mention only 1954. (A "locker code" fact made SmolLM2 answer with code.)
    "year": Attribute("{p} was born in {v}.", "In which year was {p} born?", "{p} was born in",
                      lambda rng: str(rng.choice([y for y in range(1901, 1990) if y != 1954]))),
}
FACTS_PREAMBLE = "Below are abstracts of research papers, with a few facts about people mixed in. A question follows.\n\n"


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _facts_sample(task: str, rng: random.Random, tokenizer, target: int, n_people: int) -> Sample:
    """`n_people` facts of one kind about different people; one of them is asked for."""
    attr = ATTRIBUTES[rng.choice(sorted(ATTRIBUTES))]
    people, values = _distinct(lambda: _person(rng), n_people), _distinct(lambda: attr.value(rng), n_people)
    facts = [attr.fact.format(p=p, v=v) for p, v in zip(people, values)]
    asked = rng.randrange(n_people)
    return _needle_sample(task, rng, tokenizer, target, list(zip(_depths(rng, n_people), facts)),
                          "\n" + attr.question.format(p=people[asked]), " " + attr.prefix.format(p=people[asked]),
                          [values[asked]], 16, FACTS_PREAMBLE)


def fact_single(rng: random.Random, tokenizer, target: int) -> Sample:
    """One fact about an invented person in real prose."""
    return _facts_sample("fact-single", rng, tokenizer, target, 1)


def fact_distractors(rng: random.Random, tokenizer, target: int) -> Sample:
    """Five facts of the same kind about five people; one is asked for."""
    return _facts_sample("fact-distractors", rng, tokenizer, target, 5)


def fact_profile(rng: random.Random, tokenizer, target: int) -> Sample:
    """Three facts of different kinds (room, city, year) about one person, far apart; one is asked for.
    A cache compressed before the question must keep all three."""
    person, kinds = _person(rng), sorted(ATTRIBUTES)
    values = [ATTRIBUTES[k].value(rng) for k in kinds]
    facts = [ATTRIBUTES[k].fact.format(p=person, v=v) for k, v in zip(kinds, values)]
    asked = rng.randrange(len(kinds))
    attr = ATTRIBUTES[kinds[asked]]
    return _needle_sample("fact-profile", rng, tokenizer, target, list(zip(_depths(rng, len(kinds)), facts)),
                          "\n" + attr.question.format(p=person), " " + attr.prefix.format(p=person),
                          [values[asked]], 16, FACTS_PREAMBLE)


def two_hop(rng: random.Random, tokenizer, target: int) -> Sample:
    """Project -> leader -> office room, with a second project/leader/room chain as a distractor."""
    projects = _distinct(lambda: f"{rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS).title()}", 2)
    people, rooms = _distinct(lambda: _person(rng), 2), _distinct(lambda: str(rng.randint(100, 9999)), 2)
    facts = [f"The {proj} project is led by {p}." for proj, p in zip(projects, people)]
    facts += [f"{p}'s office is in room {r}." for p, r in zip(people, rooms)]
    return _needle_sample(
        "two-hop", rng, tokenizer, target, list(zip(_depths(rng, 4), facts)),
        f"\nIn which room is the office of the person who leads the {projects[0]} project?",
        f" The office of the person who leads the {projects[0]} project is in room", [rooms[0]], 16, FACTS_PREAMBLE)


def _sentence_with(abstract: str, name: str) -> str:
    pattern = _name_pattern(name)
    return next(s for s in _sentences()[load_abstracts().index(abstract)] if pattern.search(s))


def qa_cloze(rng: random.Random, tokenizer, target: int) -> Sample:
    """An abstract's sentence quoted with the proposed method's name blanked out: name the method."""
    abstracts = load_abstracts()
    index, name = rng.choice([c for c in qa_candidates() if len(abstracts[c[0]]) <= 2 * target])
    pattern = _name_pattern(name)
    blanked = pattern.sub("___", _sentence_with(abstracts[index], name))
    pool = [i for i, text in enumerate(abstracts) if i != index and not pattern.search(text)]
    units = _abstract_stream(rng, 10**9, pool=pool, repeat=False)
    depth = rng.uniform(0.05, 0.95)
    preamble = "Below are abstracts of research papers. Read them carefully; a question follows.\n\n"

    def build(k: int) -> tuple[str, str, str]:
        return preamble + "\n\n".join(_paragraphs_with(units, k, abstracts[index], depth)), "", ""

    n_words = sum(len(s.split()) for _, s in units)
    context, _, _ = _fit(tokenizer, build, target - _count(tokenizer, blanked) - 40, n_words, 1.4, "qa-cloze")
    question = f'\nOne of the abstracts contains this sentence, with a name replaced by ___: "{blanked}" What is the name?'
    return Sample("qa-cloze", context, question, " The name is", (name,), 24)


TASKS: dict[str, Callable[[random.Random, object, int], Sample]] = {
    "niah-single-number": _niah_single("niah-single-number", "number", lambda rng, key: _number(rng), 16),
    "niah-single-noise": _niah_single("niah-single-noise", "number", lambda rng, key: _number(rng), 16, noise=True),
    "niah-single-word": _niah_single("niah-single-word", "word", _word_value, 16),
    "niah-single-uuid": _niah_single("niah-single-uuid", "uuid", _uuid_value, 48),
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

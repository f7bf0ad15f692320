"""What the long-context tasks are built from: the `Sample` a task makes, the word lists, and haystacks of real
abstracts or noise sentences with needles rendered at chosen depths, fitted to a target token count."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from kvmem.calibration import load_abstracts
from kvmem.errors import KVMemError

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


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


@lru_cache(maxsize=1)
def abstract_sentences() -> tuple[tuple[str, ...], ...]:
    """Each abstract split into sentences."""
    split = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\"])")
    return tuple(tuple(split.split(a)) for a in load_abstracts())


@lru_cache(maxsize=1)
def corpus_words() -> frozenset[str]:
    return frozenset(re.findall(r"[a-z]+", "\n".join(load_abstracts()).lower()))


@lru_cache(maxsize=1)
def plain_nouns() -> tuple[str, ...]:
    """Built-in nouns that never occur in the abstracts (safe needle values and common words)."""
    return tuple(w for w in NOUNS if w not in corpus_words())


def random_number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def distinct(make: Callable[[], str], k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        value = make()
        if value not in out:
            out.append(value)
    return out


def random_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def fit_to_length(tokenizer, build: Callable[[int], tuple[str, str, str]], target: int, max_units: int,
         rate: float, task: str) -> tuple[str, str, str]:
    """Largest k (found by interpolation, then bisection) whose build(k) is at most `target` tokens."""

    def size(k: int) -> int:
        return count_tokens(tokenizer, "".join(build(k)))

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


def abstract_stream(rng: random.Random, min_words: int, pool: Sequence[int] | None = None,
                     repeat: bool = True) -> list[Unit]:
    """Sentences of the abstracts in a shuffled order (reshuffled and repeated if `repeat`)."""
    pool = list(range(len(load_abstracts()))) if pool is None else list(pool)
    units: list[Unit] = []
    words, para = 0, 0
    while words < min_words and (repeat or para == 0):
        order = pool[:]
        rng.shuffle(order)
        for i in order:
            units += [(para, s) for s in abstract_sentences()[i]]
            words += len(load_abstracts()[i].split())
            para += 1
            if words >= min_words:
                break
    return units


def noise_stream(min_words: int) -> list[Unit]:
    words_per_round = sum(len(s.split()) for s in NOISE)
    return [(0, s) for _ in range(min_words // words_per_round + 1) for s in NOISE]


def take_words(units: Sequence[Unit], n_words: int) -> list[Unit]:
    """The first `n_words` words of `units`, cutting the last sentence if needed."""
    out: list[Unit] = []
    for para, sentence in units:
        if n_words <= 0:
            break
        words = sentence.split()
        out.append((para, sentence if len(words) <= n_words else " ".join(words[:n_words])))
        n_words -= len(words)
    return out


def render(units: Sequence[Unit], needles: Sequence[tuple[float, str]]) -> str:
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


def needle_sample(task: str, rng: random.Random, tokenizer, target: int, needles: Sequence[tuple[float, str]],
                   question: str, prefix: str, answers: Sequence[str], max_new: int, preamble: str,
                   noise: bool = False) -> Sample:
    units = noise_stream(target + 100) if noise else abstract_stream(rng, target + 100)
    n_words = sum(len(s.split()) for _, s in units)

    def build(k: int) -> tuple[str, str, str]:
        return preamble + render(take_words(units, k), needles), question, prefix

    context, _, _ = fit_to_length(tokenizer, build, target, n_words, 1.4, task)
    return Sample(task, context, question, prefix, tuple(answers), max_new)


def needle_depths(rng: random.Random, k: int) -> list[float]:
    return [rng.uniform(0.05, 0.95) for _ in range(k)]

"""Tasks over real prose with facts about invented people hidden in it (fact-single, fact-distractors, fact-profile,
two-hop), and `qa-cloze`: a quoted sentence with the proposed method's name blanked out."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from kvmem.calibration import load_abstracts
from kvmem_bench.longctx.haystack import (ADJECTIVES, NOUNS, Sample, abstract_sentences, abstract_stream, count_tokens, distinct, fit_to_length, needle_depths, needle_sample)
from kvmem_bench.longctx.ruler import name_pattern, paragraphs_with, qa_candidates


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


def random_person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _facts_sample(task: str, rng: random.Random, tokenizer, target: int, n_people: int) -> Sample:
    """`n_people` facts of one kind about different people; one of them is asked for."""
    attr = ATTRIBUTES[rng.choice(sorted(ATTRIBUTES))]
    people, values = distinct(lambda: random_person(rng), n_people), distinct(lambda: attr.value(rng), n_people)
    facts = [attr.fact.format(p=p, v=v) for p, v in zip(people, values)]
    asked = rng.randrange(n_people)
    return needle_sample(task, rng, tokenizer, target, list(zip(needle_depths(rng, n_people), facts)),
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
    person, kinds = random_person(rng), sorted(ATTRIBUTES)
    values = [ATTRIBUTES[k].value(rng) for k in kinds]
    facts = [ATTRIBUTES[k].fact.format(p=person, v=v) for k, v in zip(kinds, values)]
    asked = rng.randrange(len(kinds))
    attr = ATTRIBUTES[kinds[asked]]
    return needle_sample("fact-profile", rng, tokenizer, target, list(zip(needle_depths(rng, len(kinds)), facts)),
                          "\n" + attr.question.format(p=person), " " + attr.prefix.format(p=person),
                          [values[asked]], 16, FACTS_PREAMBLE)


def two_hop(rng: random.Random, tokenizer, target: int) -> Sample:
    """Project -> leader -> office room, with a second project/leader/room chain as a distractor."""
    projects = distinct(lambda: f"{rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS).title()}", 2)
    people, rooms = distinct(lambda: random_person(rng), 2), distinct(lambda: str(rng.randint(100, 9999)), 2)
    facts = [f"The {proj} project is led by {p}." for proj, p in zip(projects, people)]
    facts += [f"{p}'s office is in room {r}." for p, r in zip(people, rooms)]
    return needle_sample(
        "two-hop", rng, tokenizer, target, list(zip(needle_depths(rng, 4), facts)),
        f"\nIn which room is the office of the person who leads the {projects[0]} project?",
        f" The office of the person who leads the {projects[0]} project is in room", [rooms[0]], 16, FACTS_PREAMBLE)


def _sentence_with(abstract: str, name: str) -> str:
    pattern = name_pattern(name)
    return next(s for s in abstract_sentences()[load_abstracts().index(abstract)] if pattern.search(s))


def qa_cloze(rng: random.Random, tokenizer, target: int) -> Sample:
    """An abstract's sentence quoted with the proposed method's name blanked out: name the method."""
    abstracts = load_abstracts()
    index, name = rng.choice([c for c in qa_candidates() if len(abstracts[c[0]]) <= 2 * target])
    pattern = name_pattern(name)
    blanked = pattern.sub("___", _sentence_with(abstracts[index], name))
    pool = [i for i, text in enumerate(abstracts) if i != index and not pattern.search(text)]
    units = abstract_stream(rng, 10**9, pool=pool, repeat=False)
    depth = rng.uniform(0.05, 0.95)
    preamble = "Below are abstracts of research papers. Read them carefully; a question follows.\n\n"

    def build(k: int) -> tuple[str, str, str]:
        return preamble + "\n\n".join(paragraphs_with(units, k, abstracts[index], depth)), "", ""

    n_words = sum(len(s.split()) for _, s in units)
    context, _, _ = fit_to_length(tokenizer, build, target - count_tokens(tokenizer, blanked) - 40, n_words, 1.4, "qa-cloze")
    question = f'\nOne of the abstracts contains this sentence, with a name replaced by ___: "{blanked}" What is the name?'
    return Sample("qa-cloze", context, question, " The name is", (name,), 24)

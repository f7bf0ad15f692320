"""Benchmark sample generators: lengths, answers in context, determinism, scoring, perplexity text."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.calibration import load_abstracts
from kvmem_bench.longctx.facts import ATTRIBUTES, CITIES, FIRST_NAMES, LAST_NAMES
from kvmem_bench.longctx.haystack import Sample, corpus_words
from kvmem_bench.longctx.ruler import qa_candidates
from kvmem_bench.longctx.tasks import TASKS, make_samples, perplexity_text, score

LENGTH = 1024


@pytest.fixture(scope="module")
def tokenizer():
    from kvmem.models import load_tokenizer

    return load_tokenizer("smollm2-135m")  # converted here on a fresh machine, never skipped


@pytest.fixture(scope="module")
def samples(tokenizer) -> dict[str, list[Sample]]:
    return {task: make_samples(task, tokenizer, LENGTH, 2, seed=0) for task in TASKS}


def n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_task_names():
    assert set(TASKS) == {
        "niah-single-number", "niah-single-noise", "niah-single-word", "niah-single-uuid", "niah-multikey", "niah-multivalue",
        "niah-multiquery", "passkey", "variable-tracking", "common-words", "qa-abstracts",
        "fact-single", "fact-distractors", "fact-profile", "two-hop", "qa-cloze",
    }


def test_abstracts_shipped():
    abstracts = load_abstracts()
    assert len(abstracts) == len(set(abstracts)) == 418
    assert len(qa_candidates()) >= 50


@pytest.mark.parametrize("task", list(TASKS))
def test_length_and_answers(task, samples, tokenizer):
    for s in samples[task]:
        assert s.task == task
        total = n_tokens(tokenizer, s.context + s.question + s.answer_prefix)
        assert 0.9 * LENGTH <= total <= LENGTH
        assert s.question.startswith("\n") and s.answers and all(s.answers) and s.max_new_tokens > 0
        for answer in s.answers:
            if task == "common-words":
                assert len(re.findall(rf"\d+\. {answer}\b", s.context)) >= 10
            elif task == "variable-tracking":
                assert f"VAR {answer} = " in s.context
            else:
                assert answer in s.context


def test_needle_values(samples):
    number = samples["niah-single-number"][0]
    assert re.fullmatch(r"\d{7}", number.answers[0])
    uuid = samples["niah-single-uuid"][0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid.answers[0])
    word = samples["niah-single-word"][0]
    assert word.answers[0].isalpha() and word.answers[0].islower() and word.answers[0] not in word.question
    assert re.fullmatch(r"\d{5}", samples["passkey"][0].answers[0])
    noise = samples["niah-single-noise"][0]  # S-NIAH-1: the same needle, in repeated noise
    assert re.fullmatch(r"\d{7}", noise.answers[0]) and "The grass is green." in noise.context
    assert "The grass is green." not in number.context
    assert len(set(samples["niah-multivalue"][0].answers)) == 4
    assert len(set(samples["niah-multiquery"][0].answers)) == 4


def test_variable_tracking_chain(samples):
    s = samples["variable-tracking"][0]
    names = s.answers
    value = re.search(r"value (\d{5})", s.question).group(1)
    assert all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    assert f"VAR {names[0]} = {value}." in s.context
    positions = [s.context.index(f"VAR {n} = ") for n in names]
    assert positions == sorted(positions)
    assert len(re.findall(r"VAR [A-Z]{5} = \d{5}\.", s.context)) == 2  # plus one distractor chain


def test_common_words_rare_words_are_rare(samples):
    s = samples["common-words"][0]
    counts: dict[str, int] = {}
    for word in re.findall(r"\d+\. (\w+)", s.context):
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert set(top) == set(s.answers)
    assert max(c for w, c in counts.items() if w not in s.answers) <= 3


def test_qa_target_name_unique(samples):
    for s in samples["qa-abstracts"]:
        name = s.answers[0]
        paragraphs = [p for p in s.context.split("\n\n") if p.startswith("Abstract ")]
        assert sum(name.lower() in p.lower() for p in paragraphs) == 1
        opening = re.search(r'begins "(.*)"', s.question).group(1)
        assert any(opening in p for p in paragraphs)


def test_depths_vary(tokenizer):
    found = [s.context.index(s.answers[0]) / len(s.context) for s in make_samples("passkey", tokenizer, 512, 6)]
    assert max(found) - min(found) > 0.3


def test_deterministic(samples, tokenizer):
    for task in ("niah-multikey", "variable-tracking", "common-words", "qa-abstracts"):
        assert make_samples(task, tokenizer, LENGTH, 2, seed=0) == samples[task]
        assert make_samples(task, tokenizer, LENGTH, 2, seed=1) != samples[task]
    # sample i does not depend on n
    assert make_samples("passkey", tokenizer, LENGTH, 1)[0] == samples["passkey"][0]


def test_errors(tokenizer):
    with pytest.raises(ValueError, match="known tasks: .*passkey"):
        make_samples("no-such-task", tokenizer, LENGTH, 1)
    with pytest.raises(ValueError, match="256"):
        make_samples("passkey", tokenizer, 100, 1)
    with pytest.raises(ValueError, match="1024"):
        make_samples("qa-abstracts", tokenizer, 600, 1)
    with pytest.raises(ValueError):
        perplexity_text(tokenizer, 512, 64, 1, kind="nope")


def test_score(samples):
    single = samples["niah-single-number"][0]
    multi = samples["niah-multivalue"][0]
    assert score(single, f"  {single.answers[0]}.") == 1.0
    assert score(single, "") == 0.0
    assert score(multi, "") == 0.0
    assert score(multi, " ".join(multi.answers)) == 1.0
    assert score(multi, f"{multi.answers[0]}, {multi.answers[2]}") == 0.5
    words = samples["common-words"][0]
    assert score(words, " ".join(a.upper() for a in words.answers[:3])) == pytest.approx(0.3)


@settings(max_examples=200, deadline=None)
@given(answers=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5), output=st.text(max_size=40))
def test_score_property(answers, output):
    sample = Sample("t", "", "\n?", "", tuple(answers), 8)
    assert 0.0 <= score(sample, output) <= 1.0
    assert score(sample, " ".join(answers)) == 1.0


@pytest.mark.parametrize("kind", ["recall", "next"])
def test_perplexity_text(tokenizer, kind):
    pairs = perplexity_text(tokenizer, 1024, 128, 3, seed=0, kind=kind)
    assert len(pairs) == 3
    for context, continuation in pairs:
        assert len(context) == 1024 and len(continuation) == 128
        context_text, continuation_text = tokenizer.decode(context), tokenizer.decode(continuation)
        assert continuation_text.startswith("\n\n")
        assert (continuation_text in context_text) == (kind == "recall")
        if kind == "recall":
            assert context_text.index(continuation_text) < len(context_text) // 2
    assert perplexity_text(tokenizer, 1024, 128, 3, seed=0, kind=kind) == pairs
    assert perplexity_text(tokenizer, 1024, 128, 3, seed=1, kind=kind) != pairs


def test_invented_names_are_not_in_the_abstracts():
    words = corpus_words()
    assert not [w for w in FIRST_NAMES + LAST_NAMES + CITIES if w.lower() in words]


@pytest.mark.parametrize("task,n_facts", [("fact-single", 1), ("fact-distractors", 5)])
def test_facts_are_inserted_once_and_one_is_asked(task, n_facts, samples):
    for s in samples[task]:
        def pattern(template: str) -> str:
            return re.escape(template).replace(re.escape("{p}"), r"([A-Z][a-z]+ [A-Z][a-z]+)").replace(re.escape("{v}"), r"(\w+)")

        attr = next(a for a in ATTRIBUTES.values() if re.fullmatch(pattern(a.question), s.question.strip()))
        found = dict(re.findall(pattern(attr.fact), s.context))
        assert len(found) == n_facts  # n_facts people, each with one fact of the asked kind
        person = next(p for p in found if p in s.question)
        assert found[person] == s.answers[0] and s.context.count(s.answers[0]) == 1
        assert s.answer_prefix.strip() == attr.prefix.format(p=person)


def test_fact_profile_states_every_kind_of_one_person(samples):
    for s in samples["fact-profile"]:
        person = re.search(r"([A-Z][a-z]+ [A-Z][a-z]+)", s.question).group(1)
        for attr in ATTRIBUTES.values():  # one fact of each kind, all about the asked person
            fact = re.escape(attr.fact.format(p=person, v="VALUE")).replace("VALUE", r"\w+")
            assert len(re.findall(fact, s.context)) == 1
        assert s.context.count(person) == len(ATTRIBUTES) and s.context.count(s.answers[0]) == 1


def test_only_a_single_answer_stops_at_the_end_of_its_line(samples):
    assert all(s.one_line for s in samples["fact-single"]) and not any(s.one_line for s in samples["niah-multivalue"])


def test_two_hop_needs_both_facts(samples):
    for s in samples["two-hop"]:
        project = re.search(r"leads the (.+) project", s.question).group(1)
        leader = re.search(rf"The {project} project is led by ([A-Z][a-z]+ [A-Z][a-z]+)\.", s.context).group(1)
        assert re.search(rf"{leader}'s office is in room {s.answers[0]}\.", s.context)
        assert leader not in s.question  # the question names the project only: the person is the first hop
        assert len(re.findall(r"project is led by", s.context)) == 2 and len(re.findall(r"office is in room", s.context)) == 2


def test_qa_cloze_quotes_the_target_sentence(samples):
    for s in samples["qa-cloze"]:
        quoted = re.search(r'___: "(.*)" What', s.question).group(1)
        assert quoted.count("___") >= 1 and s.answers[0] not in quoted
        assert quoted.replace("___", s.answers[0]) in s.context

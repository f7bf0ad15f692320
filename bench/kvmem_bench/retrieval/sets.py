"""The retrieval benchmark's two sets, both with exactly one relevant document per query, both built from text
shipped with kvmem:

- `abstracts` (issue 3's construction): from the 418 unique seed abstracts (`load_abstracts()`), query =
  the abstract's first sentence (the first two if the first has fewer than 12 words), document = the rest
  of that abstract; the corpus is every document. Lexically biased: an opening shares words with the rest.
- `questions`: hand-written questions about individual abstracts, shipped in `data/questions.txt`
  (`<the abstract's first 60+ characters>\t<question>`). Each question describes what the paper does in
  plain words and avoids the abstract's distinctive terms (no method names, no acronyms, few shared content
  words; `lexical_overlap` measures it and the report prints it for both sets). The corpus is the same
  documents as `abstracts` (every other abstract is a distractor), so one embedding of the corpus serves
  both sets. Fixed text, so fully deterministic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvmem.calibration import load_abstracts
from kvmem.errors import KVMemError
from kvmem_bench import DATA

SETS = ("abstracts", "questions")
QUESTIONS_FILE = DATA / "questions.txt"
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\"])")
_WORD = re.compile(r"[a-z0-9]+")
STOP = frozenset("""a an and are as at be by can do does for from has have how in into is it its of on or
that the their them these this to was we what when which while who why with without our us you your""".split())


@dataclass(frozen=True)
class RetrievalSet:
    name: str
    queries: list[str]
    docs: list[str]
    relevant: list[int]  # index into docs of each query's one relevant document


def _split_abstracts() -> list[tuple[str, str, str]]:
    """(full abstract, opening, rest) for every abstract with something after its opening sentence(s)."""
    out = []
    for abstract in load_abstracts():
        sents = _SENTENCE.split(abstract)
        k = 1 if len(sents[0].split()) >= 12 else 2
        if len(sents) > k:
            out.append((abstract, " ".join(sents[:k]), " ".join(sents[k:])))
    return out


def abstracts_set(limit: int | None = None) -> RetrievalSet:
    """Opening sentence(s) -> rest of the abstract; see the module doc."""
    split = _split_abstracts()[:limit]
    return RetrievalSet("abstracts", [q for _, q, _ in split], [d for _, _, d in split], list(range(len(split))))


def questions_set(limit: int | None = None) -> RetrievalSet:
    """Hand-written questions -> the rest of their abstract, among the same documents as `abstracts_set`."""
    split = _split_abstracts()
    queries, relevant = [], []
    for line in QUESTIONS_FILE.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, question = line.split("\t")
        match = [i for i, (a, _, _) in enumerate(split) if a.startswith(key)]
        if len(match) != 1:
            raise KVMemError(f"{QUESTIONS_FILE.name}: {len(match)} abstracts start with {key!r} (need exactly one)")
        queries.append(question.strip())
        relevant.append(match[0])
    docs = [d for _, _, d in split]
    if limit is not None:  # keep the limited queries' documents plus distractors, up to `limit` documents
        queries, relevant = queries[:limit], relevant[:limit]
        keep = sorted(set(relevant))
        keep += [i for i in range(len(docs)) if i not in set(keep)][:max(0, limit - len(keep))]
        index = {d: j for j, d in enumerate(keep)}
        docs, relevant = [docs[d] for d in keep], [index[r] for r in relevant]
    return RetrievalSet("questions", queries, docs, relevant)


def load_set(name: str, limit: int | None = None) -> RetrievalSet:
    if name == "abstracts":
        return abstracts_set(limit)
    if name == "questions":
        return questions_set(limit)
    raise KVMemError(f"unknown retrieval set {name!r}; choose from {', '.join(SETS)}")


def lexical_overlap(s: RetrievalSet) -> float:
    """Mean fraction of a query's content words (not stop words) that occur in its relevant document."""
    fracs = []
    for q, r in zip(s.queries, s.relevant):
        words = {w for w in _WORD.findall(q.lower()) if w not in STOP}
        doc = set(_WORD.findall(s.docs[r].lower()))
        fracs.append(len(words & doc) / max(len(words), 1))
    return float(np.mean(fracs))

"""Multi-document QA benchmark for non-prefix chunk reuse (`kvmem.reuse.blend`), built offline.

A sample is `docs_per_sample` real paper abstracts (`data/abstracts.txt`, 120-200 words each, about 1.2k
tokens in all), each a separately precomputed chunk, with facts about invented people inserted at a random
sentence boundary (names, cities and years from `kvmem_bench.longctx.tasks`, none of which occurs in the abstracts).
Two kinds of question:

* `cross-doc`: a statement runs over a chunk boundary, as when a passage is split into chunks: chunk A ends with
  "The Quiet Otter project is led by Mara Velden.", the next chunk B starts with "The project leader's office
  is in room 4127."; a third chunk says "Tomas Okafor's office is in room 1355." (the distractor). Question: "In
  which room is Mara Velden's office?". B's tokens only know whose office it is if they attended to A.
* `single-doc`: three people, one fact each of a different kind (office room, home city, birth year), in three
  documents (at a random sentence boundary); one is asked for directly.

The prompt goes through the model's chat template: head (template head and a one-line preamble, the shared
prefix), the documents (each tokenized on its own, ending in a blank line), then the question, the end of the
user turn, the generation prompt and an answer prefix. Every method answers from the same token ids; `full` is
the plain prefill of them. Score: the expected string is in the greedy answer (normalized, `tasks.score_output`).

`run_rag` appends one record per sample x method (x recompute ratio) to `records.jsonl` as each sample finishes
(an interrupted run resumes), then writes `summary.json`, `report.md` and `score_vs_compute.png`.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kvmem import __version__
from kvmem.errors import KVMemError
from kvmem.calibration import load_abstracts
from kvmem_bench.stats import bootstrap_mean, paired_difference
from kvmem_bench.longctx.facts import ATTRIBUTES, random_person
from kvmem_bench.longctx.haystack import ADJECTIVES, NOUNS, abstract_sentences, distinct
from kvmem_bench.longctx.tasks import score_output
from kvmem.models import LoadedModel, load_model
from kvmem.prompts import _template_parts
from kvmem.reuse.blend import METHODS, assemble_and_answer, precompute
from kvmem_bench.records import git_commit, read_records

RAG_METHODS = (*METHODS, "infoflow-inorder")  # infoflow-inorder: infoflow's selection without its chunk reordering

KINDS = ("cross-doc", "single-doc")
PREAMBLE = "Below are abstracts of research papers, with a few facts about people mixed in. A question follows.\n\n"
DOC_END = "\n\n"
WORDS = (120, 200)  # abstract length range (words)
MAX_NEW_TOKENS = 16


@dataclass(frozen=True)
class RagSample:
    kind: str
    docs: tuple[str, ...]
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    fact_docs: tuple[int, ...]  # the documents holding the facts the answer needs, in the order they are used


def _insert(rng: random.Random, abstract_index: int, facts: list[str]) -> str:
    """The abstract with each fact put at a random sentence boundary (never first, so it reads as inserted)."""
    sentences = list(abstract_sentences()[abstract_index])
    for fact in facts:
        sentences.insert(rng.randint(1, len(sentences)), fact)
    return " ".join(sentences)


def make_sample(kind: str, rng: random.Random, k: int = 5) -> RagSample:
    """One sample of `kind` with `k` documents (deterministic given `rng`)."""
    if kind not in KINDS:
        raise KVMemError(f"unknown RAG question kind {kind!r}; choose from {', '.join(KINDS)}")
    if k < 3:
        raise KVMemError(f"a RAG sample needs at least 3 documents (got {k})")
    pool = [i for i, a in enumerate(load_abstracts()) if WORDS[0] <= len(a.split()) <= WORDS[1]]
    abstracts = rng.sample(pool, k)
    people = distinct(lambda: random_person(rng), 3)
    if kind == "cross-doc":
        project = f"{rng.choice(ADJECTIVES).title()} {rng.choice(NOUNS).title()}"
        rooms = distinct(lambda: ATTRIBUTES["room"].value(rng), 2)
        a = rng.randrange(k - 1)  # the fact runs over the boundary of chunks a and a + 1
        other = rng.choice([j for j in range(k) if j not in (a, a + 1)])
        docs = [" ".join(abstract_sentences()[i]) for i in abstracts]
        docs[a] += f" The {project} project is led by {people[0]}."
        docs[a + 1] = f"The project leader's office is in room {rooms[0]}. " + docs[a + 1]
        docs[other] = _insert(rng, abstracts[other], [ATTRIBUTES["room"].fact.format(p=people[1], v=rooms[1])])
        attr, asked, answer, used = ATTRIBUTES["room"], people[0], rooms[0], (a, a + 1)
    else:
        kinds = sorted(ATTRIBUTES)
        values = [ATTRIBUTES[a].value(rng) for a in kinds]
        where = rng.sample(range(k), 3)
        facts = {j: ATTRIBUTES[a].fact.format(p=p, v=v) for j, a, p, v in zip(where, kinds, people, values)}
        docs = [_insert(rng, i, [facts[j]] if j in facts else []) for j, i in enumerate(abstracts)]
        n = rng.randrange(3)
        attr, asked, answer, used = ATTRIBUTES[kinds[n]], people[n], values[n], (where[n],)
    question, prefix = attr.question.format(p=asked), attr.prefix.format(p=asked)
    return RagSample(kind, tuple(docs), question, prefix, (answer,), used)


def make_samples(n: int, seed: int = 0, kinds: Sequence[str] = KINDS, k: int = 5) -> list[RagSample]:
    """`n` samples of each kind; sample i of a kind depends only on (kind, seed, i, k)."""
    return [make_sample(kind, random.Random(f"rag:{kind}:{seed}:{i}"), k) for kind in kinds for i in range(n)]


def prompt_ids(tokenizer, sample: RagSample) -> tuple[list[int], list[list[int]], list[int]]:
    """(head, one token list per document, question + end of turn + generation prompt + answer prefix)."""
    head, tail = _template_parts(tokenizer)
    encode = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731 - the template has them
    return (encode(head + PREAMBLE), [encode(d + DOC_END) for d in sample.docs],
            encode(sample.question + tail + sample.answer_prefix))


def _configs(methods: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, float | None]]:
    return [(m, r) for m in methods for r in (ratios if m not in ("none", "full") else [None])]


def _key(r: dict) -> tuple:
    return r["model"], r["kind"], r["sample"], r["method"], r["recompute_ratio"]


def run_sample(lm: LoadedModel, sample: RagSample, configs: list[tuple[str, float | None]]) -> list[dict]:
    """Precompute the sample's documents once, then answer with every (method, ratio)."""
    head, doc_ids, question = prompt_ids(lm.tokenizer, sample)
    t0 = time.perf_counter()
    docs = [precompute(lm, d, head) for d in doc_ids]  # (`full` reads only their tokens)
    precompute_s = time.perf_counter() - t0
    out = []
    for method, ratio in configs:
        res = assemble_and_answer(lm, head, docs, question, method.removesuffix("-inorder"), ratio or 0.0,
                                  MAX_NEW_TOKENS, reorder=not method.endswith("-inorder"), answers=sample.answers)
        out.append(dict(method=method, recompute_ratio=ratio, score=score_output(sample.answers, res.text),
                        output=res.text, token_layers=res.token_layers, full_token_layers=res.full_token_layers,
                        compute_fraction=res.compute_fraction, wall_s=res.seconds, precompute_s=precompute_s,
                        order=res.order, recomputed=int(res.selected.numel()), prompt_tokens=res.cache.get_seq_length()
                        - max(len(res.tokens) - 1, 0), fact_docs=list(sample.fact_docs)))
    return out


def run_rag(models: Sequence[str] = ("smollm2-135m",),
            methods: Sequence[str] = ("full", "none", "cacheblend", "infoflow"),
            samples: int = 20, recompute_ratio: float | Sequence[float] = 0.15, out: Path = Path("results/rag"),
            seed: int = 0, kinds: Sequence[str] = KINDS, docs_per_sample: int = 5, progress: bool = True) -> Path:
    """Run what `out/records.jsonl` lacks (`samples` per question kind), then write the summary, report and plot.
    `recompute_ratio` may be a list (a sweep of cacheblend and infoflow). Returns `out`."""

    ratios = [float(r) for r in ([recompute_ratio] if isinstance(recompute_ratio, (int, float)) else recompute_ratio)]
    bad = [m for m in methods if m not in RAG_METHODS]
    if bad or not methods:
        raise KVMemError(f"unknown reuse methods {bad}; choose from {', '.join(RAG_METHODS)}")
    if any(not 0.0 <= r <= 1.0 for r in ratios) or not ratios:
        raise KVMemError(f"recompute ratios must be in [0, 1]; got {ratios}")
    if samples < 1:
        raise KVMemError("samples must be at least 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done = {_key(r) for r in read_records(path)}
    stamp = dict(kvmem=__version__, commit=git_commit(), threads=torch.get_num_threads(), seed=seed,
                 docs=docs_per_sample)
    configs = _configs(methods, ratios)
    all_samples = make_samples(samples, seed, kinds, docs_per_sample)
    for name in models:
        todo = [(i % samples, s) for i, s in enumerate(all_samples)
                if any((name, s.kind, i % samples, m, r) not in done for m, r in configs)]
        if not todo:
            continue
        lm = load_model(name)
        for n, (i, s) in enumerate(todo):
            missing = [(m, r) for m, r in configs if (name, s.kind, i, m, r) not in done]
            recs = run_sample(lm, s, missing)
            lines = "".join(json.dumps(dict(model=name, kind=s.kind, sample=i, **r, **stamp)) + "\n" for r in recs)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            if progress:
                scores = " ".join(f"{_label(r['method'], r['recompute_ratio'])}={r['score']:.0f}" for r in recs)
                print(f"[rag] {name} {n + 1}/{len(todo)} {s.kind} #{i}: {scores}", flush=True)
    write_summary(out)
    return out


def _label(method: str, ratio: float | None) -> str:
    return method if ratio is None else f"{method} r={ratio:g}"


def summarize(records: list[dict]) -> list[dict]:
    """One row per model x method x ratio x question set (each kind, and `all`: kinds weigh the same)."""
    cells: dict[tuple, dict[tuple, dict]] = {}
    for r in records:
        cells.setdefault((r["model"], r["method"], r["recompute_ratio"]), {})[(r["kind"], r["sample"])] = r
    rows = []
    rank = {m: i for i, m in enumerate(("full", "none", "cacheblend", "infoflow", "infoflow-inorder"))}
    for (model, method, ratio), recs in sorted(cells.items(), key=lambda c: (c[0][0], rank.get(c[0][1], 9),
                                                                              c[0][2] or 0)):
        for subset in ("all", *sorted({k for k, _ in recs})):
            keys = sorted(k for k in recs if subset in ("all", k[0]))
            row = dict(model=model, method=method, recompute_ratio=ratio, questions=subset, n=len(keys))
            strata = [k[0] for k in keys] if subset == "all" else None
            row["score"] = list(bootstrap_mean([recs[k]["score"] for k in keys], strata))
            row["compute_fraction"] = sum(recs[k]["compute_fraction"] for k in keys) / len(keys)
            row["wall_s"] = sum(recs[k]["wall_s"] for k in keys) / len(keys)
            for ref in ("none", "full"):
                other = cells.get((model, ref, None), {})
                common = [k for k in keys if k in other]
                if ref != method and len(common) >= 2:
                    d = paired_difference([recs[k]["score"] for k in common], [other[k]["score"] for k in common],
                                          [k[0] for k in common] if subset == "all" else None)
                    row[f"vs_{ref}"] = dict(diff=list(d), significant=d.significant, n=len(common))
            rows.append(row)
    return rows


def _cell(row: dict, ref: str) -> str:
    d = row.get(f"vs_{ref}")
    if d is None:
        return "–"
    e, lo, hi = d["diff"]
    return f"{e:+.2f} [{lo:+.2f}, {hi:+.2f}]{' *' if d['significant'] else ''}"


def write_summary(out: Path) -> None:
    """summary.json, report.md and score_vs_compute.png from `out/records.jsonl`."""
    records = read_records(out / "records.jsonl")
    if not records:
        raise KVMemError(f"no records in {out / 'records.jsonl'}")
    rows = summarize(records)
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    commits = sorted({r.get("commit", "unknown") for r in records})
    lines = ["# RAG chunk reuse (non-prefix): multi-document QA", "",
             "Each document's KV precomputed on its own after the template head, assembled at new positions "
             "(keys moved), then answered (see `bench/kvmem_bench/rag/runner.py`, `src/kvmem/reuse/blend.py`). Score: the "
             "expected string is in the greedy answer; mean with its 95 % bootstrap CI (`all`: kinds weigh the "
             "same, stratified). Differences are paired on the same samples; * marks a CI that excludes 0. "
             "Compute: token-layers of documents + question computed, as a fraction of a full prefill "
             "(the template head is a prefix-cache hit for every method; infoflow's question-scoring passes are "
             "included). `infoflow-inorder`: infoflow's token selection without its chunk reordering (ablation). "
             "wall s: one method's prefill + decode, without the documents' precompute (shared by all reuse methods; "
             "CPU, so only roughly comparable).", "",
             f"Records: {len(records)}; kvmem commit(s): {', '.join(commits)}; "
             f"threads: {sorted({r.get('threads') for r in records})}.", ""]
    for model in sorted({r["model"] for r in rows}):
        for subset in ("all", *KINDS):
            sub = [r for r in rows if r["model"] == model and r["questions"] == subset]
            if not sub:
                continue
            lines += [f"## {model}: {subset} questions (n = {sub[0]['n']} per method)", "",
                      "| method | score [95% CI] | vs none | vs full | compute fraction | wall s |",
                      "|---|---|---|---|---|---|"]
            for r in sub:
                s = r["score"]
                lines.append(f"| {_label(r['method'], r['recompute_ratio'])} | {s[0]:.2f} [{s[1]:.2f}, {s[2]:.2f}] | "
                             f"{_cell(r, 'none')} | {_cell(r, 'full')} | {r['compute_fraction']:.3f} | "
                             f"{r['wall_s']:.1f} |")
            lines.append("")
    split = [r for r in records if r["kind"] == "cross-doc" and r["method"] == "infoflow" and "order" in r
             and not _adjacent(r["order"], r["fact_docs"])]
    moved = [r for r in records if r["kind"] == "cross-doc" and r["method"] == "infoflow"]
    if moved:
        there = sum(r["score"] for r in split) / max(len(split), 1)
        lines += [f"infoflow's reordering separated the two chunks a cross-doc statement runs over in {len(split)} of "
                  f"{len(moved)} cross-doc runs (mean score there {there:.2f}); `infoflow-inorder` keeps the retrieval "
                  "order.", ""]
    _plot([r for r in rows if r["questions"] == "all"], out / "score_vs_compute.png")
    lines += ["![score vs compute](score_vs_compute.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def _adjacent(order: list[int], pair: list[int]) -> bool:
    """Whether chunk pair[1] directly follows chunk pair[0] in `order`."""
    i = order.index(pair[0])
    return i + 1 < len(order) and order[i + 1] == pair[1]


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, method) in sorted({(r["model"], r["method"]) for r in rows}):
        pts = sorted((r["compute_fraction"], *r["score"]) for r in rows if (r["model"], r["method"]) == (model, method))
        x, y = [p[0] for p in pts], [p[1] for p in pts]
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{method} ({model})")
    ax.set_xlabel("prefill compute (fraction of full, token-layers)")
    ax.set_ylabel("score (all questions, 95% CI)")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""A small benchmark of semantic lookup with verification (`kvmem.reuse.semantic`) against exact chunk reuse.

`run_semantic(lm, n)` builds `n` pairs of chat prompts: one document (abstracts of `load_abstracts()`, a
different one per pair, cut to a varying length that is not a multiple of the chunk) with two different
questions. The first prompt of each pair is prefilled into two stores, one used by chunk reuse (`prefill`), one
by semantic reuse (`prefill_semantic`, which remembers it); both stores keep every earlier pair too, so the
lookup has to find the right document among all remembered prompts (all share the chat template's head). The
second prompt is then answered three ways: cold (one forward, no store), chunk reuse, semantic reuse. Per pair
(one JSON line in OUT/semantic.jsonl): tokens reused by each, what a perfect retriever would have found (an
exhaustive token scan over every remembered prompt), TTFT of each (until the first token's logits; semantic
includes the embedding lookup, its remember step is timed apart), the largest |logit| difference to cold, and
whether the first 16 greedy tokens equal the cold ones.

`run_similar(lm, n)` is the second scenario: SemShareKV (`kvmem.reuse.semshare`) against token recycling on pairs of
semantically similar, not token-identical prompts. Each pair is one document with one question, remembered (exactly,
as token recycling stores it), and a variant of that document with the same question: its sentences reordered (the
first two moved to the end), a few words changed (one word in twelve replaced by a word of another abstract), or a
sentence inserted at its start. The variant is answered cold (one forward, no store), by token recycling
(`prefill_semantic`: the common token prefix, here the chat template's head and whatever precedes the first change)
and by semshare at each recompute ratio; per pair (OUT/semshare-MODEL.jsonl): tokens reused, TTFT (until the first token's
logits, lookup and loads included), the compute share in token-layers, and the first `answer_tokens` greedy tokens
against the cold ones (equal or not, ROUGE-L F1 and token F1). The summary (OUT/semshare-MODEL.json) gives per
method and variant kind the median TTFT speedup over cold with a bootstrap CI (the pairs' own ratios) and the quality
means with 95% bootstrap CIs, and semshare's paired difference to recycling.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.calibration import load_abstracts
from kvmem.generate import decode
from kvmem.prompts import build_prompt
from kvmem.reuse.prefix import prefill
from kvmem.reuse.semantic import prefill_semantic
from kvmem.reuse.semantic_index import SemanticIndex
from kvmem.store import ChunkStore

QUESTIONS = (
    ("What is the main contribution of the last paper above?", "Which datasets or benchmarks does it evaluate on?"),
    ("Summarize the method of the last paper in one sentence.", "What problem does the last paper address?"),
    ("Name the model or system the last paper proposes.", "How does it compare with earlier approaches?"),
    ("What are the key results reported at the end?", "Which limitation of prior work is mentioned?"),
)


def _document(tokenizer, start: int, target: int, chunk: int) -> str:
    """Abstracts from `start` on, cut at a word so the text is about `target` tokens and not a whole number of
    chunks long."""
    abstracts = load_abstracts()
    words: list[str] = []
    i = start
    while len(tokenizer(" ".join(words), add_special_tokens=False).input_ids) < target:
        words += abstracts[i % len(abstracts)].split()
        i += 1
    lo, hi = 1, len(words)
    while lo < hi:  # the fewest words reaching the target
        mid = (lo + hi) // 2
        if len(tokenizer(" ".join(words[:mid]), add_special_tokens=False).input_ids) >= target:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _fresh_records(n: int, threads: int | None, out: Path, name: str) -> Path:
    """Checks the pair count, sets the thread count, and empties OUT/NAME, the run's records file."""
    if n < 1:
        raise KVMemError(f"n must be >= 1 pair, got {n}")
    if threads:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("")
    return out / name


@torch.no_grad()
def run_semantic(lm, n: int = 20, out: Path = Path("results/reuse"), chunk_size: int = 256, embedder="minilm",
                 k: int = 4, answer_tokens: int = 16, threads: int | None = 1, seed: int = 0, log=print) -> dict:
    """Run the benchmark (see the module doc) on a loaded model; writes OUT/semantic.jsonl (replaced) and returns
    the summary (also written as OUT/semantic_summary.json)."""
    out = Path(out)
    path = _fresh_records(n, threads, out, "semantic.jsonl")
    chunk_store = ChunkStore("memory?max=64GiB", chunk_size=chunk_size)
    index = SemanticIndex(ChunkStore("memory?max=64GiB", chunk_size=chunk_size), embedder)
    config = lm.model.config
    new = lambda: KVCache(config)  # noqa: E731
    records = []
    for i in range(n):
        target = 260 + (seed * 37 + i * 97) % 330  # 260..589 document tokens, rarely chunk-aligned
        doc = _document(lm.tokenizer, 7 * i + seed, target, chunk_size)
        qa, qb = QUESTIONS[i % len(QUESTIONS)]
        first, second = build_prompt(lm.tokenizer, doc, qa), build_prompt(lm.tokenizer, doc, qb)
        a, b = first.ids, second.ids
        shared = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefill(lm, new(), a, chunk_store)  # the first request of the pair, into both stores
        prefill_semantic(lm, new(), a, index, k=k)
        oracle = min(index.scan(b), len(b) - 1)
        runs = {}
        for name, fn in (("cold", lambda c: prefill(lm, c, b, None)), ("chunk", lambda c: prefill(lm, c, b, chunk_store)),
                         ("semantic", lambda c: prefill_semantic(lm, c, b, index, k=k))):
            cache = new()
            seconds, (logits, report) = _timed(lambda: fn(cache))
            answer = decode(lm, cache, logits, answer_tokens, stop_at_newline=False)
            runs[name] = (seconds, logits, report, answer)
        cold_s, cold_logits, _, cold_answer = runs["cold"]
        chunk_s, chunk_logits, chunk_report, chunk_answer = runs["chunk"]
        sem_s, sem_logits, sem, sem_answer = runs["semantic"]
        rec = dict(pair=i, model=lm.name, chunk=chunk_size, embedder=str(embedder), k=k, prompt_tokens=len(b),
                   document_tokens=len(first.context), shared_tokens=shared, oracle_tokens=oracle,
                   chunk_reused=chunk_report.reused_tokens, semantic_reused=sem.reused_tokens, semantic_path=sem.path,
                   candidate_tokens=sem.candidate_tokens, ttft_cold_s=cold_s, ttft_chunk_s=chunk_s,
                   ttft_semantic_s=sem_s - sem.remember_s, lookup_s=sem.lookup_s, remember_s=sem.remember_s,
                   semantic_load_s=sem.load_s, semantic_prefill_s=sem.prefill_s,
                   chunk_max_logit_diff=float((chunk_logits - cold_logits).abs().max()),
                   semantic_max_logit_diff=float((sem_logits - cold_logits).abs().max()),
                   chunk_answer_equal=chunk_answer == cold_answer, semantic_answer_equal=sem_answer == cold_answer,
                   answer=lm.tokenizer.decode(cold_answer), threads=torch.get_num_threads())
        records.append(rec)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"pair {i}: {len(b)} tokens, shared {shared}: chunk reused {rec['chunk_reused']}, semantic "
            f"{rec['semantic_reused']} ({sem.path}); TTFT cold {cold_s:.3f} chunk {chunk_s:.3f} semantic "
            f"{rec['ttft_semantic_s']:.3f} s (lookup {sem.lookup_s:.3f}); answers equal: chunk "
            f"{rec['chunk_answer_equal']}, semantic {rec['semantic_answer_equal']}")
    summary = summarize(records)
    (out / "semantic_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summarize(records: list[dict]) -> dict:
    """Means of reused tokens, medians of TTFT, and the fractions of equal answers over the pairs."""
    mean = lambda key: statistics.fmean(r[key] for r in records)  # noqa: E731
    median = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    return dict(
        pairs=len(records), model=records[0]["model"], chunk=records[0]["chunk"], embedder=records[0]["embedder"],
        prompt_tokens=mean("prompt_tokens"), shared_tokens=mean("shared_tokens"),
        chunk_reused=mean("chunk_reused"), semantic_reused=mean("semantic_reused"), oracle_reused=mean("oracle_tokens"),
        semantic_path=sum(r["semantic_path"] == "semantic" for r in records) / len(records),
        # the k nearest by embedding held the prompt a perfect retriever finds (reuse may still stay with whole
        # chunks when the extra tokens are fewer than min_gain)
        retrieval_recall=sum(r["candidate_tokens"] >= r["oracle_tokens"] for r in records) / len(records),
        computed_cold=mean("prompt_tokens"), computed_chunk=mean("prompt_tokens") - mean("chunk_reused"),
        computed_semantic=mean("prompt_tokens") - mean("semantic_reused"),
        ttft_cold_s=median("ttft_cold_s"), ttft_chunk_s=median("ttft_chunk_s"), ttft_semantic_s=median("ttft_semantic_s"),
        lookup_s=median("lookup_s"), remember_s=median("remember_s"),
        speedup_chunk=median("ttft_cold_s") / median("ttft_chunk_s"),
        speedup_semantic=median("ttft_cold_s") / median("ttft_semantic_s"),
        chunk_answer_equal=sum(r["chunk_answer_equal"] for r in records) / len(records),
        semantic_answer_equal=sum(r["semantic_answer_equal"] for r in records) / len(records),
        max_logit_diff_chunk=max(r["chunk_max_logit_diff"] for r in records),
        max_logit_diff_semantic=max(r["semantic_max_logit_diff"] for r in records),
    )


# -- the similar-prompt scenario: semshare against token recycling ---------------------------------------------------
VARIANTS = ("reordered", "words changed", "sentence inserted")
INSERTED = "This summary was written for a reading group that meets every week to discuss recent work."


def variant(doc: str, kind: str, seed: int) -> str:
    """The document with its sentences reordered, a few words changed, or a sentence inserted at its start."""
    rng = random.Random(seed)
    if kind == "reordered":
        sentences = doc.split(". ")
        return ". ".join(sentences[2:] + sentences[:2]) if len(sentences) > 2 else ". ".join(sentences[::-1])
    if kind == "words changed":
        words, other = doc.split(), load_abstracts()[(seed * 31 + 5) % len(load_abstracts())].split()
        for i in range(rng.randrange(12), len(words), 12):
            words[i] = rng.choice(other)
        return " ".join(words)
    if kind == "sentence inserted":
        return f"{INSERTED} {doc}"
    raise KVMemError(f"unknown variant {kind!r}; choose from {', '.join(VARIANTS)}")


def _lcs(a: list, b: list) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b):
            prev, row[j + 1] = row[j + 1], prev + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased words (1.0 for two empty texts)."""
    a, b = candidate.lower().split(), reference.lower().split()
    if not a or not b:
        return float(a == b)
    lcs = _lcs(a, b)
    return 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))


def token_f1(candidate: str, reference: str) -> float:
    """SQuAD-style F1 of the words two texts share (as multisets)."""
    from collections import Counter

    a, b = Counter(candidate.lower().split()), Counter(reference.lower().split())
    if not a or not b:
        return float(a == b)
    common = sum((a & b).values())
    return 0.0 if common == 0 else 2 * common / (sum(a.values()) + sum(b.values()))


@torch.no_grad()
def run_similar(lm, n: int = 24, out: Path = Path("results/reuse"), ratios=(0.15, 0.3), chunk_size: int = 256,
                embedder="minilm", answer_tokens: int = 32, threads: int | None = 1, seed: int = 0,
                raw_prompt: bool = False, log=print) -> dict:
    """Run the similar-prompt scenario (see the module doc); writes OUT/semshare-MODEL.jsonl (replaced) and returns
    the summary (also OUT/semshare-MODEL.json)."""
    from kvmem.reuse.semshare import prefill_semshare

    out = Path(out)
    path = _fresh_records(n, threads, out, f"semshare-{lm.name}.jsonl")
    index = SemanticIndex(ChunkStore("memory?max=64GiB", chunk_size=chunk_size), embedder)
    new = lambda: KVCache(lm.model.config)  # noqa: E731
    warm = build_prompt(lm.tokenizer, load_abstracts()[0], QUESTIONS[0][0], raw=raw_prompt).ids
    index.embed(lm, warm)  # the embedder loads (and the first forwards run) before anything is timed
    prefill(lm, new(), warm, None)
    records = []
    for i in range(n):
        kind = VARIANTS[i % len(VARIANTS)]
        doc = _document(lm.tokenizer, 5 * i + seed + 3, 300 + (seed * 41 + i * 89) % 250, chunk_size)
        question = QUESTIONS[i % len(QUESTIONS)][0]
        first = build_prompt(lm.tokenizer, doc, question, raw=raw_prompt)
        second = build_prompt(lm.tokenizer, variant(doc, kind, seed * 1000 + i), question, raw=raw_prompt)
        a, b = first.ids, second.ids
        prefill_semantic(lm, new(), a, index)  # the reference, remembered with every earlier pair's
        shared = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        runs = {}

        def cold():
            cache = new()
            return cache, prefill(lm, cache, b, None)[0], None

        def recycling():
            cache = new()
            logits, report = prefill_semantic(lm, cache, b, index, remember=False)
            return cache, logits, report

        def semshare(ratio):
            return lambda: prefill_semshare(lm, b, index, ratio, always_from=len(second.context), remember=False)

        for name, fn in (("cold", cold), ("recycling", recycling),
                         *((f"semshare@{r:g}", semshare(r)) for r in ratios)):
            seconds, (cache, logits, report) = _timed(fn)
            answer = decode(lm, cache, logits, answer_tokens, stop_at_newline=False)
            runs[name] = (seconds, report, lm.tokenizer.decode(answer), answer)
        cold_s, _, cold_text, cold_tokens = runs["cold"]
        n_layers = lm.model.config.get_text_config().num_hidden_layers
        for name, (seconds, report, text, tokens) in runs.items():
            rec = dict(pair=i, model=lm.name, variant=kind, method=name, prompt_tokens=len(b), reference_tokens=len(a),
                       shared_tokens=shared, ttft_s=seconds, speedup=cold_s / seconds,
                       reused_tokens=report.reused_tokens if report else 0,
                       path=report.path if report else "cold",
                       compute_fraction=(getattr(report, "token_layers", None) or n_layers * report.computed_tokens)
                       / (n_layers * len(b)) if report else 1.0,
                       matched_tokens=getattr(report, "matched_tokens", None),
                       recomputed_tokens=getattr(report, "recomputed_tokens", None),
                       match_score=report.match_score if report else None,
                       exact=tokens == cold_tokens, rouge_l=rouge_l(text, cold_text), token_f1=token_f1(text, cold_text),
                       answer=text, threads=torch.get_num_threads(), embedder=str(embedder))
            records.append(rec)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        log(f"pair {i} ({kind}): {len(b)} tokens, shared prefix {shared}; " + "; ".join(
            f"{name} reused {r.reused_tokens if r else 0} in {s:.3f} s ({cold_s / s:.1f}x), "
            f"{'=' if t == cold_tokens else 'rouge ' + format(rouge_l(x, cold_text), '.2f')}"
            for name, (s, r, x, t) in runs.items() if name != "cold"))
    summary = summarize_similar(records)
    (out / f"semshare-{lm.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summarize_similar(records: list[dict]) -> dict:
    """Per method (and per method and variant): pairs, mean tokens reused and compute share, the median TTFT speedup
    over cold with its bootstrap CI, exact-match rate, ROUGE-L and token F1 against the cold answer with 95% bootstrap
    CIs (stratified by variant), and each semshare ratio's paired difference to recycling."""
    from kvmem_bench.stats import bootstrap_mean, bootstrap_median, paired_difference

    by: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by[r["method"]].append(r)
    rows = []
    for method, rs in by.items():
        for kind in (None, *VARIANTS):
            sel = [r for r in rs if kind is None or r["variant"] == kind]
            if not sel:
                continue
            strata = [r["variant"] for r in sel] if kind is None else None
            row = dict(method=method, variant=kind or "all", pairs=len(sel),
                       prompt_tokens=statistics.fmean(r["prompt_tokens"] for r in sel),
                       reused_tokens=statistics.fmean(r["reused_tokens"] for r in sel),
                       compute_fraction=statistics.fmean(r["compute_fraction"] for r in sel),
                       speedup=list(bootstrap_median([r["speedup"] for r in sel])),
                       ttft_s=statistics.median(r["ttft_s"] for r in sel))
            for q in ("exact", "rouge_l", "token_f1"):
                row[q] = list(bootstrap_mean([float(r[q]) for r in sel], strata))
            if method.startswith("semshare"):
                base = {(r["pair"]): r for r in by["recycling"] if kind is None or r["variant"] == kind}
                mine = [r for r in sel if r["pair"] in base]
                for q in ("rouge_l", "reused_tokens", "speedup"):
                    row[f"{q}_vs_recycling"] = list(paired_difference([float(r[q]) for r in mine],
                                                                      [float(base[r["pair"]][q]) for r in mine],
                                                                      [r["variant"] for r in mine] if kind is None else None))
            rows.append(row)
    return dict(model=records[0]["model"], embedder=records[0]["embedder"], pairs=len(by["cold"]), rows=rows)

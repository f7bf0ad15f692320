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
"""

from __future__ import annotations

import json
import statistics
import time
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


@torch.no_grad()
def run_semantic(lm, n: int = 20, out: Path = Path("results/reuse"), chunk_size: int = 256, embedder="minilm",
                 k: int = 4, answer_tokens: int = 16, threads: int | None = 1, seed: int = 0, log=print) -> dict:
    """Run the benchmark (see the module doc) on a loaded model; writes OUT/semantic.jsonl (replaced) and returns
    the summary (also written as OUT/semantic_summary.json)."""
    if n < 1:
        raise KVMemError(f"n must be >= 1 pair, got {n}")
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "semantic.jsonl"
    path.write_text("")
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

"""Offline retrieval benchmark for `kvmem.embed`: nDCG@10, Recall@1/10, MRR@10, throughput, bytes/vector.

Two sets, both with exactly one relevant document per query, both built from text shipped with kvmem:

- `abstracts` (issue 3's construction): from the 418 unique seed abstracts (`load_abstracts()`), query =
  the abstract's first sentence (the first two if the first has fewer than 12 words), document = the rest
  of that abstract; the corpus is every document. Lexically biased: an opening shares words with the rest.
- `questions`: hand-written questions about individual abstracts, shipped in `data/questions.txt`
  (`<the abstract's first 60+ characters>\t<question>`). Each question describes what the paper does in
  plain words and avoids the abstract's distinctive terms (no method names, no acronyms, few shared content
  words; `lexical_overlap` measures it and the report prints it for both sets). The corpus is all 418 full
  abstracts, so every other abstract is a distractor. Fixed text, so fully deterministic.

Scores: float32 = cosine similarity; int8 = integer dot of codes calibrated on the documents; binary =
matching sign bits (see `kvmem.embed.base`). Ties are counted against the relevant document (pessimistic).
TF-IDF is fitted on the corpus being searched (`Embedder.fit(docs)` is called for every method).

Run: `kvmem eval --suite retrieval --models smollm2-135m --methods mean,last,prompteol,echo,minilm,tfidf
--layers 10,15,20,-1 --out results/retrieval`.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvmem.embed import (EMBEDDERS, PRECISIONS, LMEmbedder, bytes_per_vector, get_embedder, hamming_scores,
                         int8_scores, quantize_embeddings)
from kvmem.errors import KVMemError
from kvmem.eval.tasks import load_abstracts

SETS = ("abstracts", "questions")
QUESTIONS_FILE = Path(__file__).parent / "data" / "questions.txt"
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


def abstracts_set(limit: int | None = None) -> RetrievalSet:
    """Opening sentence(s) -> rest of the abstract; see the module doc."""
    queries, docs = [], []
    for abstract in load_abstracts():
        sents = _SENTENCE.split(abstract)
        k = 1 if len(sents[0].split()) >= 12 else 2
        if len(sents) <= k:
            continue
        queries.append(" ".join(sents[:k]))
        docs.append(" ".join(sents[k:]))
    n = len(docs) if limit is None else limit
    return RetrievalSet("abstracts", queries[:n], docs[:n], list(range(min(n, len(docs)))))


def questions_set(limit: int | None = None) -> RetrievalSet:
    """Hand-written questions -> their abstract among all abstracts; see the module doc."""
    abstracts = list(load_abstracts())
    queries, relevant = [], []
    for line in QUESTIONS_FILE.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, question = line.split("\t")
        match = [i for i, a in enumerate(abstracts) if a.startswith(key)]
        if len(match) != 1:
            raise KVMemError(f"{QUESTIONS_FILE.name}: {len(match)} abstracts start with {key!r} (need exactly one)")
        queries.append(question.strip())
        relevant.append(match[0])
    if limit is not None:  # keep the limited queries' abstracts plus distractors, up to `limit` documents
        queries, relevant = queries[:limit], relevant[:limit]
        keep = sorted(set(relevant))
        keep += [i for i in range(len(abstracts)) if i not in set(keep)][:max(0, limit - len(keep))]
        index = {d: j for j, d in enumerate(keep)}
        abstracts, relevant = [abstracts[d] for d in keep], [index[r] for r in relevant]
    return RetrievalSet("questions", queries, abstracts, relevant)


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


def ranks(scores: np.ndarray, relevant: Sequence[int]) -> np.ndarray:
    """1-based rank of each query's relevant document; ties with it count against it."""
    rel = scores[np.arange(len(scores)), relevant][:, None]
    return (scores >= rel).sum(axis=1)


def metrics(rank: np.ndarray, k: int = 10) -> dict[str, float]:
    """nDCG@k, Recall@1, Recall@k, MRR@k for one relevant document per query, from its 1-based ranks."""
    rank = np.asarray(rank, dtype=np.float64)
    hit = rank <= k
    return {
        f"ndcg@{k}": float(np.mean(np.where(hit, 1.0 / np.log2(rank + 1), 0.0))),
        "recall@1": float(np.mean(rank <= 1)),
        f"recall@{k}": float(np.mean(hit)),
        f"mrr@{k}": float(np.mean(np.where(hit, 1.0 / rank, 0.0))),
    }


def score(queries: np.ndarray, docs: np.ndarray, precision: str) -> np.ndarray:
    """(nq, nd) similarities of float32 embeddings quantized to `precision` (int8 calibrated on docs)."""
    q = queries / np.maximum(np.linalg.norm(queries, axis=1, keepdims=True), 1e-12)
    d = docs / np.maximum(np.linalg.norm(docs, axis=1, keepdims=True), 1e-12)
    if precision == "float32":
        return q @ d.T
    if precision == "int8":
        return int8_scores(quantize_embeddings(q, "int8", d), quantize_embeddings(d, "int8", d))
    return hamming_scores(quantize_embeddings(q, "binary"), quantize_embeddings(d, "binary"))


def _embed_all(embedder, s: RetrievalSet, layers: list[int], batch_size: int) -> tuple[dict, float]:
    """{layer: (query embeddings, doc embeddings)} and texts/s (one pass serves every layer)."""
    embedder.fit(s.docs)
    t0 = time.perf_counter()
    if isinstance(embedder, LMEmbedder):
        q = embedder.encode_layers(s.queries, layers, batch_size)
        d = embedder.encode_layers(s.docs, layers, batch_size)
        out = {layer: (q[layer], d[layer]) for layer in layers}
    else:
        out = {None: (embedder.encode(s.queries, batch_size), embedder.encode(s.docs, batch_size))}
    return out, (len(s.queries) + len(s.docs)) / (time.perf_counter() - t0)


def run_retrieval(models: list[str], methods: list[str], sets: list[str], out: Path,
                  layers: Sequence[int] = (-1,), limit: int | None = None, batch_size: int = 8,
                  precisions: Sequence[str] = PRECISIONS) -> list[dict]:
    """Every set x model x method x layer x precision; writes `out/results.json` and `out/report.md`."""
    from kvmem.models import load_model

    for m in methods:
        if m not in EMBEDDERS:
            raise KVMemError(f"unknown embedding method {m!r}; choose from {', '.join(EMBEDDERS)}")
    data = {name: load_set(name, limit) for name in sets}
    rows: list[dict] = []
    loaded = {name: load_model(name) for name in models} if any(issubclass(EMBEDDERS[m], LMEmbedder) for m in methods) else {}
    for set_name, s in data.items():
        for method in methods:
            lm_method = issubclass(EMBEDDERS[method], LMEmbedder)
            for model in (models if lm_method else ["-"]):
                if lm_method:
                    lm = loaded[model]
                    n = lm.config.get_text_config().num_hidden_layers
                    embedder = get_embedder(method, lm)
                    use = sorted({_layer(x, n) for x in layers})
                else:
                    embedder, use = get_embedder(method), [None]
                embs, speed = _embed_all(embedder, s, use, batch_size)
                for layer, (q, d) in embs.items():
                    for precision in precisions:
                        rank = ranks(score(q, d, precision), s.relevant)
                        rows.append({"set": set_name, "model": model, "method": method, "layer": layer,
                                     "precision": precision, **metrics(rank), "n_queries": len(s.queries),
                                     "n_docs": len(s.docs), "dim": int(d.shape[1]),
                                     "bytes_per_vector": bytes_per_vector(int(d.shape[1]), precision),
                                     "texts_per_s": round(speed, 2)})
                        print(_row_line(rows[-1]), flush=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "report.md").write_text(report(rows, data))
    return rows


def _layer(x: int, n: int) -> int:
    if not -(n + 1) <= x <= n:
        raise KVMemError(f"layer {x} out of range for a model with {n} layers")
    return x % (n + 1)


def _row_line(r: dict) -> str:
    return (f"{r['set']:10s} {r['model']:13s} {r['method']:10s} layer={r['layer']!s:4s} {r['precision']:8s} "
            f"nDCG@10={r['ndcg@10']:.3f} R@1={r['recall@1']:.3f} R@10={r['recall@10']:.3f} MRR@10={r['mrr@10']:.3f}")


def report(rows: list[dict], data: dict[str, RetrievalSet]) -> str:
    lines = ["# kvmem retrieval benchmark", "",
             "Regenerate: `kvmem eval --suite retrieval --models smollm2-135m --methods mean,last,prompteol,echo,"
             "minilm,tfidf --layers 10,15,20,-1 --out results/retrieval` (see `kvmem/eval/retrieval.py` for the sets).",
             "", "float32 = cosine; int8 = per-dimension symmetric codes calibrated on the documents, integer dot; "
             "binary = sign bits, matching-bit count. Throughput = texts/s embedding queries + documents on this "
             "machine's CPU (one pass serves every layer of an LLM method).", ""]
    for name, s in data.items():
        rs = [r for r in rows if r["set"] == name]
        if not rs:
            continue
        lines += [f"## {name}: {len(s.queries)} queries, {len(s.docs)} documents, "
                  f"query-word overlap with the relevant document {lexical_overlap(s):.2f}", "",
                  "| model | method | layer | nDCG@10 | R@1 | R@10 | MRR@10 | nDCG@10 int8 | nDCG@10 binary | "
                  "bytes f32/int8/bin | texts/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        keys = list(dict.fromkeys((r["model"], r["method"], r["layer"]) for r in rs))
        for model, method, layer in keys:
            by = {r["precision"]: r for r in rs if (r["model"], r["method"], r["layer"]) == (model, method, layer)}
            f = by.get("float32") or next(iter(by.values()))
            get = lambda p: f"{by[p]['ndcg@10']:.3f}" if p in by else "–"  # noqa: E731
            size = "/".join(str(bytes_per_vector(f["dim"], p)) for p in PRECISIONS)
            lines.append(f"| {model} | {method} | {'–' if layer is None else layer} | {f['ndcg@10']:.3f} | "
                         f"{f['recall@1']:.3f} | {f['recall@10']:.3f} | {f['mrr@10']:.3f} | {get('int8')} | "
                         f"{get('binary')} | {size} | {f['texts_per_s']:.1f} |")
        lines.append("")
    return "\n".join(lines)

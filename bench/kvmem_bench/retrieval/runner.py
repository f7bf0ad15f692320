"""Offline retrieval benchmark for `kvmem.embed`: nDCG@10, Recall@1/10, MRR@10, throughput, bytes/vector, on the
sets of `sets.py`.

Scores: float32 = cosine similarity; int8 = integer dot of codes calibrated on the documents; binary =
matching sign bits (see `kvmem.embed.base`). Ties are counted against the relevant document (pessimistic).
TF-IDF is fitted on the corpus being searched (`Embedder.fit(docs)` is called for every method).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from kvmem.embed import (PRECISIONS, LMEmbedder, bytes_per_vector, get_embedder, hamming_scores, int8_scores,
                         is_lm_method, parse_method, quantize_embeddings)
from kvmem.embed.index import VectorIndex
from kvmem.errors import KVMemError
from kvmem_bench.retrieval.report import report, row_line
from kvmem_bench.retrieval.sets import SETS, RetrievalSet, load_set


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


def standardize(queries: np.ndarray, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-dimension z-scoring fitted on the documents (the searched corpus): every dimension gets mean 0
    and variance 1 over the documents, so a few huge "outlier" dimensions of LM states stop dominating cosine."""
    mean, std = docs.mean(0), docs.std(0) + 1e-6
    return (queries - mean) / std, (docs - mean) / std


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def score(queries: np.ndarray, docs: np.ndarray, precision: str) -> np.ndarray:
    """(nq, nd) similarities of float32 embeddings quantized to `precision` (int8 calibrated on docs)."""
    q, d = _unit(queries), _unit(docs)
    if precision == "float32":
        return q @ d.T
    if precision == "int8":
        return int8_scores(quantize_embeddings(q, "int8", d), quantize_embeddings(d, "int8", d))
    return hamming_scores(quantize_embeddings(q, "binary"), quantize_embeddings(d, "binary"))


def _embed(embedder, texts: list[str], layers: list, batch_size: int) -> tuple[dict, float]:
    """{layer: embeddings} ({None: ...} for non-LLM methods; one pass serves every layer) and texts/s."""
    t0 = time.perf_counter()
    if isinstance(embedder, LMEmbedder):
        out = embedder.encode_layers(texts, layers, batch_size)
    else:
        out = {None: embedder.encode(texts, batch_size)}
    return out, len(texts) / (time.perf_counter() - t0)


def run_retrieval(models: list[str], methods: list[str], sets: list[str], out: Path,
                  layers: Sequence[int] | str = (-1,), limit: int | None = None, batch_size: int = 8,
                  precisions: Sequence[str] = PRECISIONS) -> list[dict]:
    """Every set x model x method x layer x precision; writes `out/results.json`, `out/report.md` and a plot.

    `methods` are specs (`parse_method`); `layers` a list (negative counts from the end) or "all" (1..n).
    Results already in `out/results.json` for the same (set, model, method) are kept and not recomputed."""
    from kvmem.models import load_model

    for m in methods:
        parse_method(m)  # unknown methods and bad options fail before any work
    data = {name: load_set(name, limit) for name in sets}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"  # appended row by row: resumable, and runs in parallel processes can share it
    done = {(r["set"], r["model"], r["method"]) for r in latest_records(records)
            if r["set"] in data and r["n_queries"] == len(data[r["set"]].queries)}
    loaded: dict = {}
    for method in methods:
        lm_method = is_lm_method(method)
        for model in (models if lm_method else ["-"]):
            todo = [name for name in data if (name, model, method) not in done]
            if not todo:
                continue
            if lm_method:
                if model not in loaded:
                    loaded[model] = load_model(model)
                n = loaded[model].config.get_text_config().num_hidden_layers
                embedder = get_embedder(method, loaded[model])
                use = list(range(1, n + 1)) if layers == "all" else sorted({_layer(x, n) for x in layers})
            else:
                embedder, use = get_embedder(method), [None]
            corpus: dict[tuple, tuple[dict, float]] = {}  # the sets share their documents: embed them once
            for set_name in todo:
                s = data[set_name]
                if tuple(s.docs) not in corpus:
                    embedder.fit(s.docs)
                    corpus[tuple(s.docs)] = _embed(embedder, s.docs, use, batch_size)
                docs, doc_speed = corpus[tuple(s.docs)]
                queries, query_speed = _embed(embedder, s.queries, use, batch_size)
                _score_and_record(s, model, method, queries, docs, doc_speed, precisions, records)
    rows = latest_records(records)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "report.md").write_text(report(rows, {name: load_set(name, limit) for name in SETS}, out))
    return rows


def _score_and_record(s: RetrievalSet, model: str, method: str, queries: dict, docs: dict, speed: float,
                      precisions: Sequence[str], records: Path) -> None:
    """Score every layer and precision; append one row each to records.jsonl."""
    for layer, d in docs.items():
        q = queries[layer]
        for precision in precisions:
            row = {"set": s.name, "model": model, "method": method, "layer": layer, "precision": precision,
                   **metrics(ranks(score(q, d, precision), s.relevant)), "n_queries": len(s.queries),
                   "n_docs": len(s.docs), "dim": int(d.shape[1]),
                   "bytes_per_vector": bytes_per_vector(int(d.shape[1]), precision), "texts_per_s": round(speed, 2)}
            if precision == "float32":
                row["zscore_ndcg@10"] = metrics(ranks(score(*standardize(q, d), precision), s.relevant))["ndcg@10"]
            if layer == max(docs, key=lambda x: x or 0):  # the last layer: the vector index on these embeddings
                row["hnsw_recall@10"], row["index_bytes_per_vector"] = index_check(q, d, precision)
            with records.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(row_line(row), flush=True)


def index_check(queries: np.ndarray, docs: np.ndarray, precision: str, k: int = 10) -> tuple[float, float]:
    """The documents (L2-normalised) in a `VectorIndex`: recall@k of its approximate (HNSW) search against
    its exact search, and the bytes per vector the index holds."""
    q, d = _unit(queries), _unit(docs)
    found = []
    for exact in (True, False):
        index = VectorIndex(d.shape[1], precision, exact=exact)
        if precision == "int8":
            index.calibrate(d)
        index.add(np.arange(len(d)), d)
        found.append(index.search(q, k)[0])
    recall = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(*found)])
    return float(recall), index.bytes / len(d)


def latest_records(path: Path) -> list[dict]:
    """All rows of records.jsonl, the latest one for each (set, model, method, layer, precision, n_queries)."""
    if not path.exists():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["set"], r["model"], r["method"], r["layer"], r["precision"], r["n_queries"])] = r
    return list(rows.values())


def _layer(x: int, n: int) -> int:
    if not -(n + 1) <= x <= n:
        raise KVMemError(f"layer {x} out of range for a model with {n} layers")
    return x % (n + 1)

"""Offline retrieval benchmark for `kvmem.embed`: nDCG@10, Recall@1/10, MRR@10, throughput, bytes/vector.

Two sets, both with exactly one relevant document per query, both built from text shipped with kvmem:

- `abstracts` (issue 3's construction): from the 418 unique seed abstracts (`load_abstracts()`), query =
  the abstract's first sentence (the first two if the first has fewer than 12 words), document = the rest
  of that abstract; the corpus is every document. Lexically biased: an opening shares words with the rest.
- `questions`: hand-written questions about individual abstracts, shipped in `data/questions.txt`
  (`<the abstract's first 60+ characters>\t<question>`). Each question describes what the paper does in
  plain words and avoids the abstract's distinctive terms (no method names, no acronyms, few shared content
  words; `lexical_overlap` measures it and the report prints it for both sets). The corpus is the same
  documents as `abstracts` (every other abstract is a distractor), so one embedding of the corpus serves
  both sets. Fixed text, so fully deterministic.

Scores: float32 = cosine similarity; int8 = integer dot of codes calibrated on the documents; binary =
matching sign bits (see `kvmem.embed.base`). Ties are counted against the relevant document (pessimistic).
TF-IDF is fitted on the corpus being searched (`Embedder.fit(docs)` is called for every method).

Run: `BENCH_COMMANDS` below (what `make bench` runs).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvmem.embed import (PRECISIONS, LMEmbedder, bytes_per_vector, get_embedder, hamming_scores, int8_scores,
                         is_lm_method, parse_method, quantize_embeddings)
from kvmem.embed.index import VectorIndex
from kvmem.errors import KVMemError
from kvmem.calibration import load_abstracts

SETS = ("abstracts", "questions")
LM_BENCH_METHODS = "mean,last,prompteol,echo,token-prepending,kv-embedding,kv-embedding:layers=none"
# kv-embedding's re-routing in other layer windows than its ID rule picks (early / late / all), per model
KV_WINDOWS = {"smollm2-135m": "kv-embedding:layers=1-7,kv-embedding:layers=20-26,kv-embedding:layers=all",
              "gemma3-270m": "kv-embedding:layers=1-3,kv-embedding:layers=14-16,kv-embedding:layers=all"}
BENCH_COMMANDS = (  # keep in sync with the Makefile's bench target
    f"kvmem eval --suite retrieval --models smollm2-135m --methods {LM_BENCH_METHODS},{KV_WINDOWS['smollm2-135m']},"
    "minilm,tfidf --layers all --threads 1 --out results/retrieval",
    f"kvmem eval --suite retrieval --models gemma3-270m --methods {LM_BENCH_METHODS},{KV_WINDOWS['gemma3-270m']} "
    "--layers all --threads 1 --out results/retrieval",
)
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
    done = {(r["set"], r["model"], r["method"]) for r in _read_records(records)
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
    rows = _read_records(records)
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
            print(_row_line(row), flush=True)


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


def _read_records(path: Path) -> list[dict]:
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


def _row_line(r: dict) -> str:
    return (f"{r['set']:10s} {r['model']:13s} {r['method']:10s} layer={r['layer']!s:4s} {r['precision']:8s} "
            f"nDCG@10={r['ndcg@10']:.3f} R@1={r['recall@1']:.3f} R@10={r['recall@10']:.3f} MRR@10={r['mrr@10']:.3f}")


def _best_layer(f32: dict, set_name: str, model: str, method: str) -> int | None:
    """The layer with the best float32 nDCG@10 of (set, model, method); None if it was not run."""
    cands = [(r["ndcg@10"], layer) for (s_, m_, me, layer), r in f32.items() if (s_, m_, me) == (set_name, model, method)]
    return max(cands)[1] if cands else None


def headline(rows: list[dict]) -> list[str]:
    """README table: nDCG@10 of every method at the layer chosen on the other set (float32, cosine)."""
    f32 = {(r["set"], r["model"], r["method"], r["layer"]): r for r in rows if r["precision"] == "float32"}
    sets = [s_ for s_ in SETS if any(k[0] == s_ for k in f32)]
    models = list(dict.fromkeys(k[1] for k in f32 if k[3] is not None))
    methods = list(dict.fromkeys(k[2] for k in f32))
    cols = [(s_, m) for s_ in sets for m in models]
    lines = ["| method | " + " | ".join(f"{s_}: {m}" for s_, m in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for method in methods:
        cells = []
        for s_, m in cols:
            other = [o for o in sets if o != s_]
            if (s_, "-", method, None) in f32:
                cells.append(_f(f32[(s_, "-", method, None)]["ndcg@10"]))
                continue
            layer = _best_layer(f32, other[0], m, method) if other else None
            r = f32.get((s_, m, method, layer))
            cells.append(f"{_f(r['ndcg@10'])} (layer {layer})" if r else "–")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def report(rows: list[dict], data: dict[str, RetrievalSet], out: Path | None = None) -> str:
    """Markdown summary: per set, model and method the last layer, the layer chosen on the *other* set (an
    honest pick: no layer is tuned on the queries it is scored on), and the oracle layer of this set."""
    rows = [r for r in rows if r["set"] in data and r["n_queries"] == len(data[r["set"]].queries)]
    f32 = {(r["set"], r["model"], r["method"], r["layer"]): r for r in rows if r["precision"] == "float32"}
    by = {(r["set"], r["model"], r["method"], r["layer"], r["precision"]): r for r in rows}

    def best_layer(set_name: str, model: str, method: str) -> int | None:
        return _best_layer(f32, set_name, model, method)

    lines = ["# kvmem retrieval benchmark", "", "Regenerate (`make bench` runs these; they may run in parallel):", "",
             "```", *BENCH_COMMANDS, "```", "", "The sets are described in `kvmem_bench/retrieval.py`.", "",
             "- **last**: nDCG@10 at the last layer (the output of the final norm).",
             "- **chosen layer**: the layer with the best nDCG@10 on the *other* set, scored here, with R@1, R@10, "
             "MRR@10, z-scored nDCG@10 (per-dimension standardisation fitted on the documents), int8 and binary "
             "nDCG@10 at that layer. This is the honest number: the layer is not tuned on these queries.",
             "- **oracle**: the best layer on this set itself (optimistic, for reference).",
             "- float32 = cosine; int8 = per-dimension symmetric codes calibrated on the documents, integer dot; "
             "binary = sign bits, matching-bit count. Bytes per vector: float32 / int8 / binary.",
             "- texts/s: documents embedded per second on this machine's CPU, one pass serving every "
             "layer; runs of two models went in parallel 1-thread processes, so compare ratios within a model.", ""]
    for name, s in data.items():
        keys = list(dict.fromkeys((m, me) for (s_, m, me, _) in f32 if s_ == name))
        if not keys:
            continue
        other = [o for o in data if o != name]
        lines += [f"## {name}: {len(s.queries)} queries, {len(s.docs)} documents, "
                  f"query-word overlap with the relevant document {lexical_overlap(s):.2f}", "",
                  "| model | method | last | chosen layer | nDCG@10 | R@1 | R@10 | MRR@10 | z-scored | int8 | binary "
                  "| oracle layer: nDCG@10 | bytes | texts/s |", "|" + "---|" * 14]
        for model, method in keys:
            layers = [layer for (s_, m_, me, layer) in f32 if (s_, m_, me) == (name, model, method)]
            lm = layers != [None]
            last = f32[(name, model, method, max(layers) if lm else None)]
            chosen = best_layer(other[0], model, method) if lm and other else None
            oracle = best_layer(name, model, method) if lm else None
            r = f32.get((name, model, method, chosen)) if chosen is not None or not lm else None
            q = {p: by.get((name, model, method, chosen, p)) if r else None for p in PRECISIONS}
            cells = [model, method, _f(last["ndcg@10"]) if lm else "–", "–" if chosen is None else str(chosen)]
            cells += [_f(r[k]) if r else "–" for k in ("ndcg@10", "recall@1", "recall@10", "mrr@10", "zscore_ndcg@10")]
            cells += [_f(q[p]["ndcg@10"]) if q[p] else "–" for p in ("int8", "binary")]
            cells.append(f"{oracle}: {_f(f32[(name, model, method, oracle)]['ndcg@10'])}" if lm else "–")
            cells += ["/".join(str(bytes_per_vector(last["dim"], p)) for p in PRECISIONS), f"{last['texts_per_s']:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    idx = [r for r in rows if "hnsw_recall@10" in r and r["set"] == "abstracts"]
    if idx:
        lines += ["## Vector index (`kvmem.embed.index.VectorIndex`, USearch) on the abstracts documents, last layer", "",
                  "Recall@10 of approximate HNSW search against exact search in the same index, and the bytes per "
                  "vector the index holds (vectors + graph + int8 scales, measured from its serialized size).", "",
                  "| model | method | HNSW recall@10 float32 / int8 / binary | index bytes/vector float32 / int8 / binary |",
                  "|---|---|---|---|"]
        for model, method in dict.fromkeys((r["model"], r["method"]) for r in idx):
            got = {r["precision"]: r for r in idx if (r["model"], r["method"]) == (model, method)}
            lines.append(f"| {model} | {method} | " + " / ".join(_f(got[p]["hnsw_recall@10"]) if p in got else "–"
                                                             for p in PRECISIONS)
                         + " | " + " / ".join(f"{got[p]['index_bytes_per_vector']:.0f}" if p in got else "–"
                                              for p in PRECISIONS) + " |")
        lines.append("")
    if out is not None and (plot := plot_layers(rows, data, Path(out))):
        lines += [f"![nDCG@10 by layer]({plot.name})", ""]
    return "\n".join(lines)


def plot_layers(rows: list[dict], data: dict[str, RetrievalSet], out: Path) -> Path | None:
    """nDCG@10 (float32) against layer: one panel per set and model, one line per LLM method, the non-LLM
    baselines as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f32 = [r for r in rows if r["precision"] == "float32"]
    models = sorted({r["model"] for r in f32 if r["layer"] is not None})
    sets = [name for name in data if any(r["set"] == name for r in f32)]
    if not models:
        return None
    fig, axes = plt.subplots(len(sets), len(models), figsize=(6 * len(models), 4 * len(sets)), squeeze=False)
    for i, name in enumerate(sets):
        for j, model in enumerate(models):
            ax = axes[i][j]
            ax.set_prop_cycle(color=plt.cm.tab20.colors)  # more methods than the default 10 colours
            for method in dict.fromkeys(r["method"] for r in f32 if r["model"] == model and r["set"] == name):
                pts = sorted((r["layer"], r["ndcg@10"]) for r in f32
                             if (r["set"], r["model"], r["method"]) == (name, model, method))
                ax.plot(*zip(*pts), marker=".", label=method)
            for r in f32:
                if r["set"] == name and r["layer"] is None:
                    ax.axhline(r["ndcg@10"], linestyle="--", linewidth=1, color="gray")
                    ax.text(0, r["ndcg@10"], r["method"], fontsize=7, va="bottom")
            ax.set(title=f"{name} — {model}", xlabel="layer", ylabel="nDCG@10")
            ax.legend(fontsize=7)
    fig.subplots_adjust(hspace=0.3)
    path = out / "ndcg_by_layer.png"
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path

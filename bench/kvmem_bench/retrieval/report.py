"""The retrieval benchmark's report (results/retrieval/report.md, the layer plot) and its README block."""

from __future__ import annotations

import json
from pathlib import Path

from kvmem.embed import PRECISIONS, bytes_per_vector
from kvmem_bench.retrieval import BENCH_COMMANDS
from kvmem_bench.retrieval.sets import SETS, RetrievalSet, lexical_overlap


def row_line(r: dict) -> str:
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
             "```", *BENCH_COMMANDS, "```", "", "The sets are described in `kvmem_bench/retrieval/sets.py`.", "",
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


README_MARKERS = ("<!-- retrieval: regenerated from results/retrieval/results.json (see results/retrieval/report.md) -->",
                  "<!-- /retrieval -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's retrieval block: nDCG@10 of every method at the layer chosen on the other set."""
    path = Path(results) / "retrieval" / "results.json"
    if not path.exists():
        return None
    return "\n".join([
        README_MARKERS[0],
        "nDCG@10 (cosine, float32) of each method on the two offline sets; an LLM method is scored at the layer "
        "that did best on the *other* set (in brackets), so no layer is tuned on the queries it is scored on. "
        "MiniLM and TF-IDF do not depend on the LLM. int8 / binary, R@1/10, MRR, z-scoring, throughput and "
        "the vector index: [results/retrieval/report.md](results/retrieval/report.md).",
        "",
        *headline(json.loads(path.read_text())),
        README_MARKERS[1],
    ])

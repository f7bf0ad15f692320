"""Markdown report and plots for the long-context benchmark (reads the rows of results.json)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvmem.eval.longctx import FULL_CACHE_MIN  # noqa: E402

PPL_PREFIX = "ppl-"
BENCH_COMMANDS = (  # keep in sync with the Makefile's bench target
    "kvmem eval --models smollm2-135m --lengths 4096 --samples 3 --threads 1 --out results/longctx",
    "kvmem eval --models gemma3-270m --lengths 4096 --samples 3 --threads 1 --out results/longctx",
    "kvmem eval --models smollm2-135m --lengths 8192 --samples 2 --threads 1 --out results/longctx",
)


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def usable_tasks(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """Full-cache score per (model, length) and task (agnostic setting)."""
    full: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["method"] == "full" and r["setting"] == "agnostic" and not r["task"].startswith(PPL_PREFIX):
            full[(r["model"], r["length"])][r["task"]] = r["score"]
    return full


def headline(rows: list[dict]) -> list[str]:
    """Per model and length, one row per method: mean score on the usable tasks in both settings and
    the ppl-recall perplexity, at each keep ratio below 1 (the full cache is the first row)."""
    full = usable_tasks(rows)
    lines = []
    for (model, length) in sorted({(r["model"], r["length"]) for r in rows}):
        rs = [r for r in rows if (r["model"], r["length"]) == (model, length)]
        ok = {t for t, sc in full.get((model, length), {}).items() if sc >= FULL_CACHE_MIN}
        ratios = sorted({r["keep_ratio"] for r in rs if r["keep_ratio"] < 1.0}, reverse=True)
        methods = [m for m in dict.fromkeys(r["method"] for r in rs) if m != "full"]

        def mean(method, ratio, pick) -> str:
            v = [r["score"] for r in rs if r["method"] == method and r["keep_ratio"] == ratio and pick(r)]
            return f"{sum(v) / len(v):.2f}" if v else "–"

        cols = [("agnostic", lambda r: r["setting"] == "agnostic" and r["task"] in ok),
                ("aware", lambda r: r["setting"] == "aware" and r["task"] in ok),
                ("ppl-recall", lambda r: r["task"] == "ppl-recall")]
        lines += [f"**{model} @ {length} tokens** — usable tasks: {', '.join(sorted(ok)) or 'none'}", "",
                  "| method | " + " | ".join(f"{c} {k:g}" for c, _ in cols for k in ratios) + " |",
                  "|---|" + "---|" * (len(cols) * len(ratios))]
        lines.append("| full (1.0) | " + " | ".join(mean("full", 1.0, pick) for _, pick in cols for _ in ratios) + " |")
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(mean(m, k, pick) for _, pick in cols for k in ratios) + " |")
        lines.append("")
    return lines


def update_readme(results: Path = Path("results/longctx/results.json"), readme: Path = Path("README.md"),
                  retrieval: Path = Path("results/retrieval/results.json")) -> None:
    """Rewrite the README's results blocks (between its `<!-- results` and `<!-- retrieval` markers) from
    the two benchmarks' results.json."""
    import json
    import re

    rows = json.loads(results.read_text())
    block = "\n".join([
        "<!-- results: regenerated from results/longctx/results.json (the Headline of results/longctx/report.md) -->",
        "Regenerate with `make bench` (hours on 2 CPU cores; it resumes from `results/longctx/records.jsonl`).",
        "Mean score over the tasks the model can do with its full cache (RULER string match, higher is better)",
        "and perplexity of a repeated passage after compressing the context (`ppl-recall`, lower is better),",
        "at keep ratios 0.5 / 0.25 / 0.1; keep ratio 1.0 is the full-cache row. Few samples (3 per task at",
        "4k, 2 at 8k) on 2-3 usable tasks: differences of one or two answers are noise. Full detail, per-task",
        "scores, measured KV bytes and plots: [results/longctx/report.md](results/longctx/report.md).",
        "",
        *headline(rows),
        "<!-- /results -->",
    ])
    text = readme.read_text()
    new = re.sub(r"<!-- results:.*?<!-- /results -->", lambda m: block, text, flags=re.S)
    if new == text and block not in text:
        raise ValueError(f"{readme} has no results block to update")
    if retrieval.exists():
        from kvmem.eval.retrieval import headline as retrieval_headline

        block = "\n".join([
            "<!-- retrieval: regenerated from results/retrieval/results.json (see results/retrieval/report.md) -->",
            "nDCG@10 (cosine, float32) of each method on the two offline sets; an LLM method is scored at the layer "
            "that did best on the *other* set (in brackets), so no layer is tuned on the queries it is scored on. "
            "MiniLM and TF-IDF do not depend on the LLM. int8 / binary, R@1/10, MRR, z-scoring, throughput and "
            "the vector index: [results/retrieval/report.md](results/retrieval/report.md).",
            "",
            *retrieval_headline(json.loads(retrieval.read_text())),
            "<!-- /retrieval -->",
        ])
        new = re.sub(r"<!-- retrieval:.*?<!-- /retrieval -->", lambda m: block, new, flags=re.S)
    readme.write_text(new)


def write_report(rows: list[dict], cfg) -> Path:
    out = Path(cfg.out)
    full = usable_tasks(rows)
    lines = [
        "# kvmem long-context benchmark",
        "",
        "Regenerate with `make bench`, which runs (each resumes from the records already in the folder):",
        "",
        "```",
        *BENCH_COMMANDS,
        "```",
        "",
        "Samples per task: see `n` in results.json. Keep ratio = fraction of context tokens kept per head; "
        "`kept` below is the measured fraction of KV bytes held after compression. Keep ratio 1.0 is the full "
        "cache for every method. Scores are the fraction of expected answer strings in the greedy output "
        "(RULER string match); perplexity tasks report perplexity (lower is better).",
        "",
        "## Which tasks count",
        "",
        f"Tasks scoring below {FULL_CACHE_MIN} with the full cache are flagged and left out of the averages: "
        "a task the model cannot do uncompressed measures nothing about compression.",
        "",
    ]
    lines += ["## Headline", "",
              "Mean score over usable tasks (higher is better) and ppl-recall perplexity (lower is better) "
              "at each keep ratio; the full cache is the first row.", "", *headline(rows)]
    lines += ["## Full-cache score per task (detail)", ""]
    tasks = sorted({t for d in full.values() for t in d})
    keys = sorted(full)
    lines.append("| task | " + " | ".join(f"{m} @ {L}" for m, L in keys) + " |")
    lines.append("|---|" + "---|" * len(keys))
    for t in tasks:
        cells = []
        for k in keys:
            s = full[k].get(t)
            cells.append("–" if s is None else f"{s:.2f}" + (" ⚠" if s < FULL_CACHE_MIN else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines.append("")

    by_key: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_key[(r["model"], r["length"])].append(r)
    for (model, length), rs in sorted(by_key.items()):
        ok = {t for t, s in full.get((model, length), {}).items() if s >= FULL_CACHE_MIN}
        lines += [f"## {model} @ {length} tokens", ""]
        if not ok:
            lines += ["No task reaches the full-cache threshold here; nothing to average.", ""]
        ratios = sorted({r["keep_ratio"] for r in rs}, reverse=True)
        methods = list(dict.fromkeys(r["method"] for r in rs))
        for setting in ("agnostic", "aware"):
            cell: dict[tuple, list[float]] = defaultdict(list)
            kept: dict[tuple, list[float]] = defaultdict(list)
            for r in rs:
                if r["setting"] == setting and r["task"] in ok:
                    cell[(r["method"], r["keep_ratio"])].append(r["score"])
                    kept[(r["method"], r["keep_ratio"])].append(r["fraction_kept"])
            if not cell:
                continue
            lines += [f"### {setting}: mean score over {len(ok)} usable tasks ({', '.join(sorted(ok))})", ""]
            lines.append("| method | " + " | ".join(f"keep {k:g}" for k in ratios) + " |")
            lines.append("|---|" + "---|" * len(ratios))
            for m in methods:
                vals = []
                for k in ratios:
                    v = cell.get((m, k))
                    vals.append("–" if not v else f"{sum(v) / len(v):.3f} (kept {sum(kept[(m, k)]) / len(kept[(m, k)]):.2f})")
                lines.append(f"| {m} | " + " | ".join(vals) + " |")
            lines.append("")
        ppl = [r for r in rs if r["task"].startswith(PPL_PREFIX)]
        if ppl:
            lines += ["### perplexity of a continuation after compressing the context (lower is better)", ""]
            ptasks = sorted({r["task"] for r in ppl})
            lines.append("| method | " + " | ".join(f"{t} keep {k:g}" for t in ptasks for k in ratios) + " |")
            lines.append("|---|" + "---|" * (len(ptasks) * len(ratios)))
            for m in methods:
                vals = []
                for t in ptasks:
                    for k in ratios:
                        v = [r["score"] for r in ppl if r["method"] == m and r["task"] == t and r["keep_ratio"] == k]
                        vals.append(f"{v[0]:.2f}" if v else "–")
                lines.append(f"| {m} | " + " | ".join(vals) + " |")
            lines.append("")
        kvrows = [r for r in rs if r["setting"] == "agnostic" and r["method"] == "snapkv"]
        if kvrows:
            lines += ["### KV bytes held (measured), agnostic setting", "", "| keep ratio | KV bytes | fraction of full |",
                      "|---|---|---|"]
            for k in ratios:
                v = [r for r in kvrows if r["keep_ratio"] == k]
                if v:
                    lines.append(f"| {k:g} | {_fmt_bytes(sum(r['kv_bytes'] for r in v) / len(v))} | "
                                 f"{sum(r['fraction_kept'] for r in v) / len(v):.3f} |")
            full_t = sum(r["prefill_s"] for r in kvrows) / len(kvrows)
            lines += ["", f"Mean prefill time (with attention tracking): {full_t:.1f} s.", ""]
        plot = _plot(rs, ok, model, length, out)
        if plot:
            lines += [f"![score vs fraction kept]({plot.name})", ""]
    lines += ["## Per-task scores", "", "| model | length | setting | task | method | " +
              " | ".join(f"keep {k:g}" for k in sorted({r['keep_ratio'] for r in rows}, reverse=True)) + " |"]
    all_ratios = sorted({r["keep_ratio"] for r in rows}, reverse=True)
    lines.append("|---|---|---|---|---|" + "---|" * len(all_ratios))
    table: dict[tuple, dict[float, float]] = defaultdict(dict)
    for r in rows:
        table[(r["model"], r["length"], r["setting"], r["task"], r["method"])][r["keep_ratio"]] = r["score"]
    for key, vals in sorted(table.items()):
        lines.append("| " + " | ".join(map(str, key)) + " | " +
                     " | ".join(f"{vals[k]:.2f}" if k in vals else "–" for k in all_ratios) + " |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _mean_curve(points: dict[float, list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    ratios = sorted(points)
    x = [sum(p[0] for p in points[k]) / len(points[k]) for k in ratios]
    y = [sum(p[1] for p in points[k]) / len(points[k]) for k in ratios]
    return x, y


def _plot(rs: list[dict], ok: set[str], model: str, length: int, out: Path) -> Path | None:
    """Score vs measured fraction of KV bytes kept, per method: agnostic, aware, and ppl-recall."""
    panels = [("agnostic", lambda r: r["setting"] == "agnostic" and r["task"] in ok, "mean score (usable tasks)"),
              ("aware", lambda r: r["setting"] == "aware" and r["task"] in ok, "mean score (usable tasks)"),
              ("ppl-recall", lambda r: r["task"] == "ppl-recall", "perplexity (log)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    drawn = False
    for ax, (title, keep, ylabel) in zip(axes, panels):
        series: dict[str, dict[float, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
        for r in rs:
            if keep(r) and r["method"] != "full":
                series[r["method"]][r["keep_ratio"]].append((r["fraction_kept"], r["score"]))
        for method, points in series.items():
            ax.plot(*_mean_curve(points), marker="o", label=method)
            drawn = True
        ax.set_title(f"{model} @ {length}: {title}")
        ax.set_xlabel("fraction of KV bytes kept")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        if title == "ppl-recall":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if not drawn:
        plt.close(fig)
        return None
    path = out / f"score_vs_kept_{model}_{length}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""The long-output benchmark's report, from its records alone: the copy task's score, fidelity to the full cache's
output and repetition, streaming perplexity, each beside the bytes the cache held; paired CIs throughout."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from kvmem_bench.longgen import FULL
from kvmem_bench.longgen.copy import copy_sample, copy_score
from kvmem_bench.perplexity import delta_ppl
from kvmem_bench.records import read_records
from kvmem_bench.stats import bootstrap_mean, paired_difference

COMMAND = "make bench-longgen"
PPL_BLOCK = 32  # tokens per bootstrap block of the perplexity CIs (neighbouring tokens are correlated)


def lcs_fraction(out: list[int], reference: list[int]) -> float:
    """Longest common subsequence of `out` and `reference`, over len(reference): how much of the full cache's output
    survives, in order (1.0: all of it)."""
    if not reference:
        return 1.0
    prev = [0] * (len(reference) + 1)
    for a in out:
        cur = [0]
        for j, b in enumerate(reference):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1] / len(reference)


def repeated_4grams(tokens: list[int]) -> float:
    """Fraction of the output's 4-grams that already occurred earlier in it (loops score near 1)."""
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    seen: set = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def _fmt(iv, digits: int = 2) -> str:
    return f"{iv[0]:.{digits}f} [{iv[1]:.{digits}f}, {iv[2]:.{digits}f}]"


def _cell_name(spec: str, ratio: float) -> str:
    return "full" if spec == FULL else spec if ratio == 1.0 else f"{spec} @ {ratio:g}"


def _setting(key: tuple) -> str:
    """How the group's methods compress: the prompt at its keep ratio, then every N tokens back to that + extra rows."""
    return f"{key[0]}, every={key[1]}" + (f", prompt kept + {key[2]} rows" if key[2] else "")


def _grouped(records: list[dict], part: str) -> dict[tuple, dict]:
    """(model, every, extra_rows) -> {(method, ratio, sample): record}, the full cache's records in every group of
    its model (it compresses nothing, so one run serves every setting)."""
    groups: dict[tuple, dict] = defaultdict(dict)
    full: dict[str, dict] = defaultdict(dict)
    for r in records:
        if r["part"] != part:
            continue
        if part == "copy":  # scored again from its output: the check is the one in copy.py now
            r = {**r, "score": copy_score(copy_sample(r["sample"])[2], r["output"])}
        if r["method"] == FULL:
            full[r["model"]][(FULL, 1.0, r["sample"])] = r
        else:
            groups[(r["model"], r["every"], r["extra_rows"])][(r["method"], r["keep_ratio"], r["sample"])] = r
    return {key: {**full[key[0]], **recs} for key, recs in groups.items() if full[key[0]]}


def _rows(records: list[dict], part: str, measure) -> dict[tuple, list[dict]]:
    """(model, every, extra_rows) -> one row per (method, ratio) on the samples every cell of the group has:
    `measure(records, full's records)` plus n and the mean bytes held over the full cache's."""
    out = {}
    for key, recs in _grouped(records, part).items():
        cells = sorted({(m, k) for m, k, _ in recs}, key=lambda c: (c[0] != FULL, -c[1], c[0]))
        samples = sorted(set.intersection(*({s for m, k, s in recs if (m, k) == c} for c in cells)))
        if not samples:
            continue
        full = [recs[(FULL, 1.0, s)] for s in samples]
        full_bytes = sum(r["mean_kv_bytes"] for r in full) / len(full)
        rows = []
        for m, k in cells:
            rs = [recs[(m, k, s)] for s in samples]
            rows.append(dict(method=m, keep_ratio=k, n=len(rs), **measure(rs, full),
                             bytes=sum(r["mean_kv_bytes"] for r in rs) / len(rs) / full_bytes))
        out[key] = rows
    return out


def _copy_measures(rs: list[dict], full: list[dict]) -> dict:
    scores = [r["score"] for r in rs]
    return dict(score=bootstrap_mean(scores), vs_full=paired_difference(scores, [r["score"] for r in full]),
                fidelity=bootstrap_mean([lcs_fraction(r["tokens"], f["tokens"]) for r, f in zip(rs, full)]),
                repeats=bootstrap_mean([repeated_4grams(r["tokens"]) for r in rs]),
                tokens=sorted(len(r["tokens"]) for r in rs)[len(rs) // 2], scores=scores)


def _ppl_measures(rs: list[dict], full: list[dict]) -> dict:
    nll = [x for r in rs for x in r["nll"]]
    return dict(tokens=len(nll), ppl=math.exp(sum(nll) / len(nll)),
                delta=delta_ppl([(r["nll"], f["nll"]) for r, f in zip(rs, full)], PPL_BLOCK))


def copy_rows(records: list[dict]) -> dict[tuple, list[dict]]:
    """The copy task's rows: score, paired difference with the full cache, fidelity, repeats, median tokens."""
    return _rows(records, "copy", _copy_measures)


def ppl_rows(records: list[dict]) -> dict[tuple, list[dict]]:
    """Streaming perplexity's rows: perplexity and Δppl against the full cache (paired block bootstrap)."""
    return _rows(records, "ppl", _ppl_measures)


def pairwise(rows: list[dict]) -> list[str]:
    """Every pair of methods at one keep ratio whose copy scores differ significantly (paired bootstrap)."""
    lines = []
    for k in sorted({r["keep_ratio"] for r in rows if r["method"] != FULL}, reverse=True):
        at = [r for r in rows if r["keep_ratio"] == k and r["method"] != FULL]
        for i, a in enumerate(at):
            for b in at[i + 1:]:
                d = paired_difference(a["scores"], b["scores"])
                verdict = "significant" if d.significant else "n.s."
                lines.append(f"- {'' if k == 1.0 else f'@ {k:g}: '}{a['method']} − {b['method']} = {_fmt(d)} ({verdict}; bytes held "
                             f"{a['bytes']:.2f} vs {b['bytes']:.2f} of full)")
    return lines


def plot(copy: dict, ppl: dict, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not copy and not ppl:
        return None
    keys = sorted(set(copy) | set(ppl))
    fig, axes = plt.subplots(len(keys), 2, figsize=(11, 4 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        for ax, rows, value, label in ((row[0], copy.get(key, []), lambda r: r["score"][0], "copy score"),
                                       (row[1], ppl.get(key, []), lambda r: r["delta"][0], "Δppl % (streaming)")):
            for m in sorted({r["method"] for r in rows}):
                pts = sorted((r["bytes"], value(r)) for r in rows if r["method"] == m)
                ax.plot(*zip(*pts), "o-" if len(pts) > 1 else "o", label=m)
            ax.set_xlabel("mean KV bytes held while decoding / full cache's")
            ax.set_ylabel(label)
            ax.set_title(_setting(key))
            ax.grid(alpha=0.3)
            if rows:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "longgen.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path) -> Path:
    records = read_records(out / "records.jsonl")
    copy, ppl = copy_rows(records), ppl_rows(records)
    picture = plot(copy, ppl, out)
    lines = ["# Long outputs: decode-phase compression", "",
             f"Regenerate with `{COMMAND}` (resumes from `results/longgen/records.jsonl`). Each method compresses inside "
             "the cache: the prompt to its keep ratio when it is read, then every `every` decoded tokens each layer back "
             "to that size + `extra_rows` (`Compressor(method, keep_ratio, every, extra_rows)`; a decode-phase method "
             "such as moment-kv evicts only generated rows, the others choose among every row held). Bytes are the KV tensors' measured bytes averaged over the "
             "decode steps, over the full cache's. 95% bootstrap CIs; differences are paired by sample.", ""]
    if picture:
        lines += [f"![long outputs]({picture.name})", ""]
    for key, rows in copy.items():
        lines += [f"## Copy a 24-entry list: {_setting(key)} (n={rows[0]['n']})", "",
                  "Score: the fraction of the prompt's 24 entries written as a line of the output. Fidelity: the longest "
                  "common subsequence with the full cache's output, over its length. Repeats: the fraction of the "
                  "output's 4-grams seen earlier in it.", "",
                  "| method | bytes held | score | − full (paired) | fidelity to full | repeats | median tokens |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {_cell_name(r['method'], r['keep_ratio'])} | {r['bytes']:.2f} | {_fmt(r['score'])} | "
                         f"{'–' if r['method'] == FULL else _fmt(r['vs_full'])} | {_fmt(r['fidelity'])} | "
                         f"{_fmt(r['repeats'])} | {r['tokens']} |")
        lines += ["", "Methods against each other at one keep ratio (copy score):", "", *pairwise(rows), ""]
    for key, rows in ppl.items():
        lines += [f"## Streaming perplexity of a held-out continuation: {_setting(key)} "
                  f"(n={rows[0]['n']} texts, {rows[0]['tokens']} tokens)", "",
                  "| method | bytes held | perplexity | Δppl % vs full [95% CI] |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {_cell_name(r['method'], r['keep_ratio'])} | {r['bytes']:.2f} | {r['ppl']:.2f} | "
                         f"{'–' if r['method'] == FULL else _fmt(r['delta'], 1)} |")
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


README_MARKERS = ("<!-- longgen: regenerated from results/longgen/report.md by `make bench-longgen` -->", "<!-- /longgen -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's long-output block: the copy tables of RESULTS/longgen/report.md."""
    path = Path(results) / "longgen" / "report.md"
    if not path.exists():
        return None
    text = path.read_text()
    tables = [part.split("\n\nMethods against", 1)[0] for part in text.split("## ")[1:] if part.startswith("Copy")]
    return (f"{README_MARKERS[0]}\n**Long outputs** (issue 35; `make bench-longgen`): decode-phase compression while "
            "the model copies a 24-entry list (278-288 output tokens); pairwise tests, streaming perplexity and the plot in "
            "[results/longgen/report.md](results/longgen/report.md).\n\n"
            + "\n\n".join("#### " + t.strip() for t in tables) + f"\n{README_MARKERS[1]}")

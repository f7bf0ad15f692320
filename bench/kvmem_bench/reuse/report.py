"""The reuse benchmark's report (results/reuse/report.md, results.json, plots) from its records: TTFT with and
without reuse per tier and codec (the speedup is the headline), the load time broken down, the codecs' bytes,
speed and quality, the issue's goals said met or not, and the RAG table (results/rag) when it exists."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from kvmem_bench.perplexity import delta_ppl
from kvmem_bench.reuse.frontier import frontier_goals, frontier_section, summarize_frontier
from kvmem_bench.records import read_records
from kvmem_bench.stats import bootstrap_mean, paired_difference

COMMAND = "make bench-reuse"
SPEEDUP_GOAL = {"memory": 50.0, "disk": 35.0}  # exact-prefix TTFT at 8k and beyond, raw codec (issue 36)
LOAD_GOAL = 2.0  # what the load adds to TTFT (read, verify, decode, import) within this many times the raw read of the bytes
CACHEGEN_GOAL = 1 / 3  # of kivi-8's bytes


def codec_quality(records: list[dict], model: str, length: int, block: int = 32) -> dict[str, tuple[float, float, float]]:
    """Delta-ppl (%, with CI) of each codec against raw at one (model, length)."""
    nll = {r["codec"]: r["nll"] for r in records if r["kind"] == "nll" and r["model"] == model and r["length"] == length}
    if "raw" not in nll:
        return {}
    return {c: delta_ppl([(v, nll["raw"])], block) for c, v in nll.items() if c != "raw"}


def codec_task_scores(records: list[dict]) -> dict[str, dict]:
    """Per model and codec: mean task score with its CI (stratified by task) and the paired difference to raw."""
    out: dict[str, dict] = {}
    latest = {(r["model"], r["task"], r["sample"], r["codec"]): r for r in records if r["kind"] == "task"}
    for model in sorted({k[0] for k in latest}):
        raw = {(k[1], k[2]): r["score"] for k, r in latest.items() if k[0] == model and k[3] == "raw"}
        for codec in sorted({k[3] for k in latest if k[0] == model}):
            mine = {(k[1], k[2]): r["score"] for k, r in latest.items() if k[0] == model and k[3] == codec}
            common = sorted(set(mine) & set(raw))
            est = bootstrap_mean([mine[c] for c in common], strata=[c[0] for c in common])
            diff = paired_difference([mine[c] for c in common], [raw[c] for c in common], strata=[c[0] for c in common])
            out[f"{model}/{codec}"] = dict(model=model, codec=codec, n=len(common), score=list(est), vs_raw=list(diff),
                                           tasks=sorted({c[0] for c in common}))
    return out


def _latest(records: list[dict], kind: str, *fields: str) -> dict[tuple, dict]:
    """The last record of each key (a rerun's records replace the earlier ones)."""
    out = {}
    for r in records:
        if r["kind"] == kind:
            out[tuple(r.get(f) for f in fields)] = r
    return out


def summarize(records: list[dict]) -> dict:
    cold = _latest(records, "cold", "model", "length")
    warm = _latest(records, "warm", "model", "length", "tier", "codec")
    sequential = _latest(records, "warm-sequential", "model", "length", "tier", "codec")
    codecs = _latest(records, "codec", "model", "length", "codec")
    quality = {f"{m}/{n}": {c: list(v) for c, v in codec_quality(records, m, n).items()} for m, n in cold}
    return {"cold": list(cold.values()), "warm": list(warm.values()), "sequential": list(sequential.values()),
            "codecs": list(codecs.values()), "quality": quality,
            "tasks": list(codec_task_scores(records).values())}


def _load_s(r: dict) -> float:
    """What a warm record's load cost: what it adds to TTFT where measured (layer-wise pipelining), else the sum of its
    parts (records from before it: then nothing overlapped the forward)."""
    return r.get("critical_load_s", r["read_s"] + r["decode_s"] + r["import_s"])


def pipelining_section(summary: dict) -> list[str]:
    """Warm TTFT with the stored layers put in place while the forward runs against every layer in place first, the
    two interleaved in one run (`runner.run_length`)."""
    seq = {(r["model"], r["length"], r["tier"], r["codec"]): r for r in summary.get("sequential", [])}
    rows = [(k, seq[k], r) for r in summary["warm"] if (k := (r["model"], r["length"], r["tier"], r["codec"])) in seq]
    if not rows:
        return []
    lines = ["", "## Layer-wise pipelining: the forward runs while later layers load", "",
             "Sequential: every stored layer verified, decoded and imported before the forward over the question starts. "
             "Overlapped (the default): a loader thread does it layer by layer while the forward runs, and the forward "
             "waits only for a layer it reaches first. The two alternate in one run (median of each); ratio = "
             "sequential / overlapped.", "",
             "| model | tokens | tier | codec | sequential TTFT s | overlapped TTFT s | ratio | forward waited s |",
             "|---|---|---|---|---|---|---|---|"]
    for (m, n, t, k), s, o in sorted(rows, key=lambda x: x[0]):
        lines.append(f"| {m} | {n} | {t} | {k} | {s['ttft_s']:.3f} | {o['ttft_s']:.3f} | {s['ttft_s'] / o['ttft_s']:.2f}× | "
                     f"{o['wait_s']:.3f} |")
    return lines


def _plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series = defaultdict(list)
    for r in summary["warm"]:
        series[(r["model"], r["tier"], r["codec"])].append((r["length"], r["speedup"]))
    for (model, tier, codec), pts in sorted(series.items()):
        if codec in ("raw", "cachegen"):
            pts.sort()
            a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {tier} {codec}")
    for goal in SPEEDUP_GOAL.values():
        a.axhline(goal, color="grey", ls="--", lw=1)
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="TTFT speedup (cold / warm)", title="reuse speedup")
    a.legend(fontsize=7)
    longest = max((r["length"] for r in summary["codecs"]), default=0)
    for r in summary["codecs"]:
        if r["length"] != longest:
            continue
        q = summary["quality"].get(f"{r['model']}/{r['length']}", {}).get(r["codec"], [0.0, 0.0, 0.0])
        b.errorbar(r["bytes_per_token"], q[0], yerr=[[q[0] - q[1]], [q[2] - q[0]]], fmt="o", capsize=3)
        b.annotate(r["codec"], (r["bytes_per_token"], q[0]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    b.set(xscale="log", xlabel="stored bytes per token", ylabel="Δppl vs raw (%)", title=f"codecs at {longest} tokens")
    fig.tight_layout()
    fig.savefig(out / "reuse.png", dpi=120)
    plt.close(fig)


def _rag_label(row: dict) -> str:
    return row["method"] if row["recompute_ratio"] is None else f"{row['method']} r={row['recompute_ratio']:g}"


def write_report(out: Path) -> Path:
    records = read_records(out / "records.jsonl")
    summary = summarize(records)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    if summary["warm"]:
        _plot(summary, out)
    lines = ["# Reuse: time to first token from stored KV", "",
             f"Reproduce: `{COMMAND}` (records in `records.jsonl`; see `kvmem_bench/reuse/runner.py` for what is timed).", ""]
    warm = {(r["model"], r["length"], r["tier"], r["codec"]): r for r in summary["warm"]}
    tiers = sorted({k[2] for k in warm}, key=["memory", "disk", "redis"].index)
    codecs = list(dict.fromkeys(k[3] for k in warm))
    cold = {(r["model"], r["length"]): r for r in summary["cold"]}
    lines += ["## TTFT: cold prefill vs reuse (median of repeats; speedup = cold / warm)", "",
              "Cold: one prefill forward of the prompt, no store (and the first request with a store: chunked, encoded, "
              "written). Warm: the same document, another question; per tier and codec.", "",
              "| model | tokens | cold TTFT s (first with store) | tier | " + " | ".join(codecs) + " |",
              "|---|---|---|---|" + "---|" * len(codecs)]
    for (m, n), c in sorted(cold.items()):
        for t in tiers:
            cells = [f"{r['ttft_s']:.3f} s ({r['speedup']:.1f}×)" if (r := warm.get((m, n, t, k))) else "" for k in codecs]
            lines.append(f"| {m} | {n} | {c['ttft_s']:.2f} ({c['with_store_s']:.2f}) | {t} | " + " | ".join(cells) + " |")
    lines += ["", "Load time broken down (raw codec; the median run): read (the time spent waiting for bytes: each piece "
              "is read while the one before it has its header checked), verify + decode and import (done layer by layer "
              "by a loader thread while the forward runs: `kvmem/reuse/pipeline.py`), prefill of the uncovered tokens "
              "(the forward, including the time it waited for a layer to be in place: waited). Load on TTFT: what the "
              "load adds to the time to first token, TTFT less the forward's own compute (prefill less waited). Raw "
              "read: the tier's reads of the same bytes and nothing else, one after another. The target (load within "
              "2× of the raw read) is read on load on TTFT / raw read; load work / raw read = (read + decode + import) / "
              "raw read is the CPU work of the load, most of it now done while the forward runs.", "",
              "| model | tokens | tier | reused / computed tokens | read s | decode s | import s | prefill s (waited) | load on TTFT s | raw read s | load on TTFT / raw read | load work / raw read | page cache dropped |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (m, n, t, k), r in sorted(warm.items()):
        if k == "raw":
            raw = r.get("raw_read_s")
            work = r["read_s"] + r["decode_s"] + r["import_s"]
            critical = r.get("critical_load_s")

            def ratio(x):  # a memory tier's read is a lookup: no ratio
                return f"{x / raw:.2f}×" if x is not None and raw and raw > 0.01 else ""

            waited = f" ({r['wait_s']:.3f})" if "wait_s" in r else ""
            lines.append(f"| {m} | {n} | {t} | {r['reused_tokens']} / {r['computed_tokens']} | {r['read_s']:.3f} | {r['decode_s']:.3f} | {r['import_s']:.3f} | {r['prefill_s']:.3f}{waited} | "
                         f"{'' if critical is None else f'{critical:.3f}'} | {'' if raw is None else f'{raw:.3f}'} | {ratio(critical)} | {ratio(work)} | "
                         f"{'' if r['page_cache_dropped'] is None else r['page_cache_dropped']} |")
    lines += pipelining_section(summary)
    lines += ["", "## Codecs: bytes per token, speed, quality", "",
              "| model | tokens | codec | bytes/token | vs raw | vs kivi-8 | encode tok/s | decode tok/s | Δppl vs raw % [95% CI] |",
              "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["length"], r["codec"]): r for r in summary["codecs"]}
    for (m, n, k), r in sorted(by.items()):
        raw, k8 = by.get((m, n, "raw")), by.get((m, n, "quant:kivi-8"))
        q = summary["quality"].get(f"{m}/{n}", {}).get(k)
        lines.append(f"| {m} | {n} | {k} | {r['bytes_per_token']:.0f} | {r['bytes'] / raw['bytes']:.3f} | "
                     f"{r['bytes'] / k8['bytes']:.2f} | {r['encode_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | "
                     f"{f'{q[0]:+.2f} [{q[1]:+.2f}, {q[2]:+.2f}]' if q else '(reference)'} |" if raw and k8 else
                     f"| {m} | {n} | {k} | {r['bytes_per_token']:.0f} | | | | | |")
    if summary["tasks"]:
        t0 = summary["tasks"][0]
        lines += ["", f"## Task score per codec ({t0['model']}, the long-context suite's usable tasks at 2048 tokens: "
                      f"{', '.join(t0['tasks'])}; agnostic prompt, the context's chunks and its partial last chunk loaded through the codec)", "",
                  "| model | codec | n | score [95% CI] | vs raw (paired) |", "|---|---|---|---|---|"]
        for r in summary["tasks"]:
            d = r["vs_raw"]
            sig = "significant" if d[1] > 0 or d[2] < 0 else "not significant"
            lines.append(f"| {r['model']} | {r['codec']} | {r['n']} | {r['score'][0]:.2f} [{r['score'][1]:.2f}, {r['score'][2]:.2f}] | "
                         + ("(reference)" if r["codec"] == "raw" else f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] ({sig})") + " |")
    sem_path = out / "semantic_summary.json"
    if sem_path.exists():
        m = json.loads(sem_path.read_text())
        lines += ["", f"## Semantic lookup with token verification ({m['pairs']} prompt pairs, {m['model']}, chunk {m['chunk']}, "
                      f"embedder {m['embedder']})", "",
                  "A document with one question is stored; the same document with another question arrives. Exact chunk reuse "
                  "gets the common prefix in whole chunks; semantic lookup finds the stored prompt by embedding and reuses "
                  "the common prefix to the token, verified on token ids.", "",
                  "| | cold | chunk reuse | semantic lookup |", "|---|---|---|---|",
                  f"| tokens reused (mean of {m['prompt_tokens']:.0f}; {m['shared_tokens']:.0f} shared) | 0 | {m['chunk_reused']:.0f} | "
                  f"{m['semantic_reused']:.0f} |",
                  f"| tokens computed (mean) | {m['computed_cold']:.0f} | {m['computed_chunk']:.0f} | {m['computed_semantic']:.0f} |",
                  f"| median TTFT s | {m['ttft_cold_s']:.3f} | {m['ttft_chunk_s']:.3f} ({m['speedup_chunk']:.1f}×) | "
                  f"{m['ttft_semantic_s']:.3f} ({m['speedup_semantic']:.1f}×; lookup {m['lookup_s']:.3f}) |",
                  f"| greedy answers equal to cold | | {m['chunk_answer_equal']:.0%} | {m['semantic_answer_equal']:.0%} |",
                  f"| largest logit difference to cold | | {m['max_logit_diff_chunk']:.1e} | {m['max_logit_diff_semantic']:.1e} |"]
    lines += similar_section(out)
    lines += frontier_section(out)
    lines += ["", "## Goals", ""]
    for m, n in sorted({(r["model"], r["length"]) for r in summary["cold"]}):
        best = {t: max(((r["speedup"], r["codec"]) for r in summary["warm"] if (r["model"], r["length"], r["tier"]) == (m, n, t)),
                       default=None) for t in ("memory", "disk", "redis")}
        said = "; ".join(f"{t} {b[0]:.1f}× ({b[1]})" for t, b in best.items() if b)
        raw = {r["tier"]: r for r in summary["warm"] if (r["model"], r["length"], r["codec"]) == (m, n, "raw")}
        goals = [f"raw from {t} {raw[t]['speedup']:.1f}× (goal ≥ {g:.0f}×: {'met' if raw[t]['speedup'] >= g else 'not met'})"
                 for t, g in SPEEDUP_GOAL.items() if t in raw]
        loads = [f"{t} {_load_s(r) / r['raw_read_s']:.2f}×" for t, r in sorted(raw.items()) if r.get("raw_read_s", 0) > 0.01]
        lines.append(f"- {m} at {n} tokens: best TTFT speedup per tier: {said}"
                     + (f"; exact-prefix targets at ≥ 8k: {', '.join(goals)}" if n >= 8192 and goals else "")
                     + (f"; load on TTFT / raw read of the bytes (goal ≤ {LOAD_GOAL:g}×): {', '.join(loads)}" if loads else ""))
        cg, k8 = by.get((m, n, "cachegen")), by.get((m, n, "quant:kivi-8"))
        if cg and k8:
            q = summary["quality"].get(f"{m}/{n}", {})
            lines.append(f"  - cachegen holds {cg['bytes'] / k8['bytes']:.2f} of kivi-8's bytes (goal ≤ 0.33: "
                         f"{'met' if cg['bytes'] / k8['bytes'] <= CACHEGEN_GOAL else 'not met'}); Δppl cachegen "
                         f"{q.get('cachegen', [float('nan')])[0]:+.2f} % vs kivi-8 {q.get('quant:kivi-8', [float('nan')])[0]:+.2f} %")
    frontier = out / "frontier.jsonl"
    if frontier.exists():
        lines += frontier_goals(summarize_frontier(read_records(frontier)))
    if summary["tasks"]:
        lines.append("- task score per codec (the long-context tasks, paired with raw): " + "; ".join(
            f"{r['codec']} {r['score'][0]:.2f} (n={r['n']}"
            + ("" if r["codec"] == "raw" else f", {r['vs_raw'][0]:+.2f} [{r['vs_raw'][1]:+.2f}, {r['vs_raw'][2]:+.2f}]") + ")"
            for r in summary["tasks"]))
    rag_summary = out.parent / "rag" / "summary.json"
    if rag_summary.exists():
        rows = [r for r in json.loads(rag_summary.read_text()) if r["questions"] == "cross-doc"]
        cells = [f"{_rag_label(r)} {r['score'][0]:.2f} [{r['score'][1]:.2f}, {r['score'][2]:.2f}] at "
                 f"{r['compute_fraction']:.0%} of the compute" for r in rows if r["method"] in ("full", "none", "cacheblend", "infoflow")]
        if cells:
            lines.append(f"- RAG, cross-document questions ({rows[0]['model']}, n={rows[0]['n']}): " + "; ".join(cells))
    rag = out.parent / "rag" / "report.md"
    if rag.exists():
        lines += ["", "## RAG: documents reused at new positions", "", f"See [`{rag.relative_to(out.parent.parent)}`](../rag/report.md)."]
    if summary["warm"]:
        lines += ["", "![reuse](reuse.png)"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"


def _ci(x: list[float], fmt: str = ".2f") -> str:
    return f"{x[0]:{fmt}} [{x[1]:{fmt}}, {x[2]:{fmt}}]"


def similar_section(out: Path) -> list[str]:
    """SemShareKV against token recycling on similar prompt pairs (OUT/semshare-MODEL.json, `run_similar`)."""
    lines = []
    for path in sorted(out.glob("semshare-*.json")):
        m = json.loads(path.read_text())
        rows = [r for r in m["rows"] if r["method"] != "cold"]
        lines += ["", f"## Similar prompts: SemShareKV against token recycling ({m['pairs']} pairs, {m['model']}, "
                      f"embedder {m['embedder']})", "",
                  "A document with a question is remembered; the same document reordered (its first two sentences "
                  "moved to the end), with one word in twelve replaced, or with a sentence inserted at its start arrives "
                  "with the same question. Token recycling reuses the common token prefix (the chat template's head); "
                  "semshare aligns the tokens to the remembered prompt's by LSH on RoPE-rotated embeddings and "
                  "recomputes the given share of them. Speedup: the median over pairs of cold TTFT / TTFT (one thread, "
                  "lookup and loads included) with a bootstrap CI; quality: the first 32 greedy tokens against the cold "
                  "answer's (exact match rate, ROUGE-L F1, token F1; means with 95% bootstrap CIs, stratified by "
                  "variant). Records: `" + path.name.replace(".json", ".jsonl") + "`; reproduce: `kvmem eval --suite reuse --parts "
                  f"semshare --models {m['model']}` (`kvmem_bench/reuse/semantic.py`, `run_similar`).", "",
                  "| method | variant | tokens reused (of) | token-layers computed | TTFT speedup | exact match | ROUGE-L | "
                  "token F1 |", "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r['variant']} ({r['pairs']}) | {r['reused_tokens']:.0f} ({r['prompt_tokens']:.0f}) | "
                         f"{r['compute_fraction']:.0%} | {_ci(r['speedup'])}× | {_ci(r['exact'])} | {_ci(r['rouge_l'])} | "
                         f"{_ci(r['token_f1'])} |")
        diffs = [r for r in rows if r["variant"] == "all" and "rouge_l_vs_recycling" in r]
        if diffs:
            lines += ["", "Paired against token recycling on the same pairs (all variants; significant when the CI "
                          "excludes 0):", ""]
            for r in diffs:
                d, t, s = r["rouge_l_vs_recycling"], r["reused_tokens_vs_recycling"], r["speedup_vs_recycling"]
                lines.append(f"- {r['method']}: tokens reused {t[0]:+.0f} [{t[1]:+.0f}, {t[2]:+.0f}], speedup "
                             f"{s[0]:+.2f} [{s[1]:+.2f}, {s[2]:+.2f}], ROUGE-L {d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]"
                             f" ({'significant' if d[1] > 0 or d[2] < 0 else 'not significant'})")
    return lines


README_MARKERS = ("<!-- reuse: regenerated from results/reuse/report.md by `make bench-reuse` -->", "<!-- /reuse -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's reuse block: the goals of RESULTS/reuse/report.md."""
    path = Path(results) / "reuse" / "report.md"
    if not path.exists():
        return None
    report = path.read_text()
    goals = report[report.index("## Goals") + len("## Goals"):].split("\n## ")[0].strip()
    return (f"{README_MARKERS[0]}\n**Reuse** (issue 10; `make bench-reuse`): time to first token with and without stored KV "
            "(prompt = document + question; the document's chunks and its partial last chunk stored), per tier and codec, and what each codec "
            "costs. Full tables: [results/reuse/report.md](results/reuse/report.md); documents reused at new positions "
            f"(cacheblend, infoflow): [results/rag/report.md](results/rag/report.md).\n\n{goals}\n{README_MARKERS[1]}")

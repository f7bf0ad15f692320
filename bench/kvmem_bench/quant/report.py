"""The quantization benchmark's report (results/quant/report.md, results.json, frontier plot), built from its
records: Delta-ppl with CIs, bytes held, decode speed against HF's QuantizedCache, the task table and the
eviction x quantization frontier, with the issue's targets said met or not."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from kvmem.errors import KVMemError
from kvmem_bench.perplexity import delta_ppl
from kvmem_bench.quant import FULL, HF_BASELINES, TEN_X
from kvmem_bench.records import read_records
from kvmem_bench.stats import Interval, bootstrap_mean, paired_difference

COMMAND = "make bench-quant"
PAIRED_MIN = 10  # no paired verdict from fewer common samples (as the long-context report)
TASK_SHARE = 0.95  # the frontier target: >= 95 % of the full-cache score


def scheme_bits(name: str) -> float | None:
    """Code bits per element of a scheme (None for the full cache)."""
    if name in (FULL, "dynamic"):
        return None
    if name in HF_BASELINES:
        return float(HF_BASELINES[name].get("nbits", 8))
    from kvmem.quant import get_scheme

    try:
        return float(get_scheme(name).bits)
    except (KVMemError, AttributeError, TypeError):
        return None


def _fmt(iv, digits: int = 2) -> str:
    return f"{iv[0]:.{digits}f} [{iv[1]:.{digits}f}, {iv[2]:.{digits}f}]"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


# -- perplexity ----------------------------------------------------------------------------------------
def ppl_rows(records: list[dict]) -> list[dict]:
    by: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in records:
        if r["part"] == "ppl":
            by[(r["model"], r["scheme"])][r["text"]] = r
    rows = []
    for (model, name), texts in sorted(by.items()):
        base = by.get((model, FULL), {})
        common = sorted(set(texts) & set(base))
        if not common:
            continue
        nll = [x for t in common for x in texts[t]["nll"]]
        full_bytes = sum(base[t]["kv_bytes"] for t in common) / len(common)
        held = sum(texts[t]["kv_bytes"] for t in common) / len(common)
        elements = sum(texts[t]["elements"] for t in common) / len(common)
        d = delta_ppl([(texts[t]["nll"], base[t]["nll"]) for t in common], texts[common[0]]["chunk"])
        rows.append(dict(model=model, scheme=name, texts=len(common), tokens=len(nll),
                         ppl=math.exp(sum(nll) / len(nll)), delta_pct=d, kv_bytes=held, kv_bytes_full=full_bytes,
                         factor=full_bytes / held, bits_per_element=8 * held / max(elements, 1), bits=scheme_bits(name)))
    return rows


def ppl_table(rows: list[dict]) -> list[str]:
    lines = []
    for model in sorted({r["model"] for r in rows}):
        sub = sorted((r for r in rows if r["model"] == model), key=lambda r: (r["scheme"] != FULL, -(r["bits"] or 99), r["scheme"]))
        r0 = sub[0]
        lines += [f"**{model}**: held-out texts of {r0['tokens'] // max(r0['texts'], 1) + 1} tokens (Δppl on the texts "
                  "both caches ran), teacher-forced in chunks of 32 (every chunk reads the cache the earlier ones left).", "",
                  "| cache | texts | code bits | ppl | Δppl % [95% CI] | KV MiB held | bits / element | fewer bytes than full |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sub:
            bits = "—" if r["bits"] is None else f"{r['bits']:g}"
            delta = "—" if r["scheme"] == FULL else _fmt(r["delta_pct"])
            lines.append(f"| {r['scheme']} | {r['texts']} | {bits} | {r['ppl']:.3f} | {delta} | {_mib(r['kv_bytes'])} | "
                         f"{r['bits_per_element']:.2f} | {r['factor']:.1f}x |")
        lines.append("")
    return lines


# -- decode --------------------------------------------------------------------------------------------
def _ratio(a: list[float], b: list[float]) -> Interval:
    """Geometric-mean ratio of paired per-step times a / b with a bootstrap CI."""
    est, lo, hi = bootstrap_mean([math.log(x / y) for x, y in zip(a, b)])
    return Interval(math.exp(est), math.exp(lo), math.exp(hi))


def hf_peer(name: str) -> str | None:
    """The HF QuantizedCache setting at the same code bits (its KIVI-like axes where it has them)."""
    bits = scheme_bits(name)
    if bits is None or name in HF_BASELINES:
        return None
    return {8: "hf-fp8", 4: "hf-quanto-4-kivi", 2: "hf-quanto-2-kivi"}.get(int(bits)) if bits == int(bits) else None


def decode_rows(records: list[dict]) -> list[dict]:
    latest: dict[tuple, dict] = {}
    for r in records:
        if r["part"] == "decode":
            latest[(r["model"], r["scheme"])] = r
    rows = []
    for (model, name), r in sorted(latest.items()):
        full = latest.get((model, FULL))
        peer = latest.get((model, hf_peer(name))) if hf_peer(name) else None
        ms = sorted(r["ms"])
        rows.append(dict(model=model, scheme=name, context_tokens=r["context_tokens"], median_ms=ms[len(ms) // 2],
                         kv_bytes=r["kv_bytes"], to_full=_ratio(r["ms"], full["ms"]) if full else None,
                         peer=hf_peer(name) if peer else None, to_peer=_ratio(r["ms"], peer["ms"]) if peer else None))
    return rows


def decode_table(rows: list[dict]) -> list[str]:
    lines = []
    for model in sorted({r["model"] for r in rows}):
        sub = [r for r in rows if r["model"] == model]
        lines += [f"**{model}** @ {sub[0]['context_tokens']} tokens (ms per decoded token; ratios: geometric mean of "
                  "paired steps, 95% CI; ≤ 1 is as fast or faster)", "",
                  "| cache | ms / token | KV MiB | / kvmem full | HF at the same bits | / HF |", "|---|---|---|---|---|---|"]
        for r in sub:
            to_full = _fmt(r["to_full"]) if r["to_full"] else "—"
            to_peer = _fmt(r["to_peer"]) if r["to_peer"] else "—"
            lines.append(f"| {r['scheme']} | {r['median_ms']:.1f} | {_mib(r['kv_bytes'])} | {to_full} | {r['peer'] or '—'} | {to_peer} |")
        lines.append("")
    return lines


# -- tasks ---------------------------------------------------------------------------------------------
def task_rows(records: list[dict]) -> list[dict]:
    cells: dict[tuple, dict[tuple, dict]] = defaultdict(dict)
    for r in records:
        if r["part"] == "tasks":
            cells[(r["model"], r["length"], r.get("setting", "agnostic"), r["cell"])][(r["task"], r["sample"])] = r
    rows = []
    for (model, length, setting, cell), got in sorted(cells.items()):
        full = cells.get((model, length, setting, FULL), {})
        keys = sorted(got)
        iv = bootstrap_mean([got[k]["score"] for k in keys], strata=[k[0] for k in keys])
        common = sorted(set(got) & set(full))
        diff = (paired_difference([got[k]["score"] for k in common], [full[k]["score"] for k in common],
                                  strata=[k[0] for k in common]) if len(common) >= PAIRED_MIN and cell != FULL else None)
        full_iv = bootstrap_mean([full[k]["score"] for k in common]) if common else None
        first = got[keys[0]]
        held = sum(got[k]["kv_bytes"] for k in keys) / len(keys)
        whole = sum(got[k]["kv_bytes_full"] for k in keys) / len(keys)
        rows.append(dict(model=model, length=length, setting=setting, cell=cell, method=first["method"], keep_ratio=first["keep_ratio"],
                         scheme=first["scheme"], n=len(keys), tasks=sorted({k[0] for k in keys}), score=tuple(iv),
                         vs_full=tuple(diff) if diff else None, full_score=full_iv.estimate if full_iv else None,
                         kv_bytes=held, kv_bytes_full=whole, factor=whole / held))
    return rows


def _meets(r: dict) -> bool:
    """>= TEN_X fewer bytes at >= TASK_SHARE of the full cache's score on the same samples."""
    return r["factor"] >= TEN_X and r["full_score"] is not None and r["score"][0] >= TASK_SHARE * r["full_score"]


def task_table(rows: list[dict]) -> list[str]:
    lines = []
    for model, length, setting in sorted({(r["model"], r["length"], r["setting"]) for r in rows}):
        sub = [r for r in rows if (r["model"], r["length"], r["setting"]) == (model, length, setting)]
        tasks = sorted({t for r in sub for t in r["tasks"]})
        lines += [f"**{model} @ {length} tokens**, {setting}, tasks {', '.join(tasks)} (stratified 95% CIs; ▼/▲: paired "
                  f"difference to the full cache significant, from >= {PAIRED_MIN} common samples; ★: >= {TEN_X:g}x "
                  f"fewer bytes at >= {TASK_SHARE:.0%} of the full score)", "",
                  "| cache | n | score | − full (paired) | KV MiB held | fewer bytes |", "|---|---|---|---|---|---|"]
        for r in sorted(sub, key=lambda r: (r["method"] != "full", r["method"], -r["keep_ratio"], r["scheme"] != FULL, r["scheme"])):
            mark = ""
            if r["vs_full"] and (r["vs_full"][1] > 0 or r["vs_full"][2] < 0):
                mark = " ▲" if r["vs_full"][0] > 0 else " ▼"
            diff = _fmt(r["vs_full"]) + mark if r["vs_full"] else "—"
            lines.append(f"| {r['cell']}{' ★' if _meets(r) else ''} | {r['n']} | {_fmt(r['score'])} | {diff} | "
                         f"{_mib(r['kv_bytes'])} | {r['factor']:.1f}x |")
        lines.append("")
    return lines


def frontier_plot(rows: list[dict], out: Path) -> Path | None:
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["setting"] == "agnostic"]  # the frontier and its target are the agnostic setting's
    if not rows:
        return None
    keys = sorted({(r["model"], r["length"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        sub = [r for r in rows if (r["model"], r["length"]) == key]
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in sub:
            groups["quantization only" if r["method"] == "full" else f"{r['method']} + quantization"].append(r)
        for label, pts in groups.items():
            ax.scatter([p["kv_bytes"] / 2**20 for p in pts], [p["score"][0] for p in pts], label=label, alpha=0.75)
        for r in sub:
            if _meets(r):
                ax.scatter([r["kv_bytes"] / 2**20], [r["score"][0]], s=160, facecolors="none", edgecolors="red")
            ax.annotate(r["cell"], (r["kv_bytes"] / 2**20, r["score"][0]), fontsize=6, alpha=0.7)
        full = sub[0]["kv_bytes_full"] / 2**20
        ax.axvline(full / TEN_X, color="red", ls=":", lw=1, label=f"{TEN_X:g}x fewer bytes")
        ax.set_xscale("log")
        ax.set_xlabel("KV MiB held (measured)")
        ax.set_ylabel("score (mean over samples)")
        ax.set_title(f"{key[0]} @ {key[1]}: eviction x quantization (red circles: >= 10x fewer bytes at >= 95% score)",
                     fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "frontier.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- targets -------------------------------------------------------------------------------------------
def target_lines(ppl: list[dict], decode: list[dict], tasks: list[dict]) -> list[str]:
    lines = ["## Targets", ""]

    def ppl_target(bits: int, goal: float) -> str:
        cand = [r for r in ppl if r["bits"] == bits and r["scheme"] not in HF_BASELINES]
        if not cand:
            return f"* {bits}-bit Δppl ≤ {goal:g} %: not measured"
        per_model = []
        for model in sorted({r["model"] for r in cand}):
            best = min((r for r in cand if r["model"] == model), key=lambda r: r["delta_pct"][0])
            ok = best["delta_pct"][2] <= goal
            per_model.append(f"{model}: best {best['scheme']} {_fmt(best['delta_pct'])} % ({'met' if ok else 'not met'})")
        return f"* **{bits}-bit Δppl ≤ {goal:g} %** (upper CI bound): " + "; ".join(per_model)

    lines += [ppl_target(4, 0.5), ppl_target(2, 5.0)]
    per_model = []
    tasks = [r for r in tasks if r["setting"] == "agnostic"]  # the target is the agnostic setting's
    for key in sorted({(r["model"], r["length"]) for r in tasks}):
        sub = [r for r in tasks if (r["model"], r["length"]) == key]
        hits = [r for r in sub if _meets(r)]
        if hits:
            per_model += [f"{r['model']} @ {r['length']} {r['cell']} ({r['factor']:.1f}x, {_fmt(r['score'])} vs "
                          f"{r['full_score']:.2f} on the same samples, n={r['n']}; by the point estimate)" for r in hits]
            continue
        kept = [r for r in sub if r["cell"] != FULL and r["full_score"] is not None
                and r["score"][0] >= TASK_SHARE * r["full_score"]]
        best = max(kept, key=lambda r: r["factor"], default=None)
        per_model.append(f"{key[0]} @ {key[1]}: not met" + (f" (at ≥ {TASK_SHARE:.0%} the most is {best['factor']:.1f}x, "
                                                             f"{best['cell']})" if best else ""))
    lines.append(f"* **≥ {TEN_X:g}x fewer bytes at ≥ {TASK_SHARE:.0%} of the full-cache task score** (bytes against the "
                 "float32 cache held here; a float16 model's full cache is half as large, so about half the factor): "
                 + ("; ".join(per_model) if per_model else "not measured"))
    slower = [r for r in decode if r["to_peer"] and r["to_peer"].lo > 1.0]
    compared = [r for r in decode if r["to_peer"]]
    lines.append("* **Decode no slower than HF's QuantizedCache at the same bits**: "
                 + ("not measured" if not compared else
                    ("met" if not slower else "not met") + f" ({len(compared) - len(slower)} of {len(compared)} schemes; "
                    + ", ".join(f"{r['model']} {r['scheme']} {r['to_peer'].estimate:.2f}x {r['peer']}" for r in compared) + ")"))
    return lines + [""]


def write_report(out: Path) -> dict:
    records = read_records(out / "records.jsonl")
    ppl, decode, tasks = ppl_rows(records), decode_rows(records), task_rows(records)
    plot = frontier_plot(tasks, out)
    lines = ["# Quantization benchmark", "",
             f"Regenerate with `{COMMAND}` (resumes from `results/quant/records.jsonl`). Every scheme of "
             "`kvmem.quant` and transformers' `QuantizedCache` (quanto: its default axes and the KIVI-like "
             "`axis_key=-1, axis_value=0`, group 32; fp8) in the same run. Bytes are measured from the tensors held "
             "(codes, scales, zero-points, outliers, exact rows and the full-precision residual); the models run in "
             "float32 here, so 'fewer bytes than full' is against float32 (half of it against float16). HF's "
             "QuantizedCache refuses models with sliding-window layers, so Gemma-3 has no HF rows.", ""]
    lines += target_lines(ppl, decode, tasks)
    lines += ["## Perplexity (Δppl against the full-precision cache)", ""] + ppl_table(ppl)
    lines += ["## Decode speed", ""] + decode_table(decode)
    lines += ["## Tasks and the eviction x quantization frontier", "",
              "HF's KIVI-like quanto settings are left out here: they group along batch x heads x tokens, so a prompt "
              "whose length times the KV heads is not a multiple of 32 fails in HF's own prefill.", ""] + task_table(tasks)
    if plot:
        lines += [f"![frontier]({plot.name})", ""]
    (out / "report.md").write_text("\n".join(lines))
    summary = dict(ppl=ppl, decode=[{**r, "to_full": tuple(r["to_full"]) if r["to_full"] else None,
                                     "to_peer": tuple(r["to_peer"]) if r["to_peer"] else None} for r in decode],
                   tasks=tasks)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    return summary


README_MARKERS = ("<!-- quant: regenerated from results/quant/report.md by `make bench-quant` -->", "<!-- /quant -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's quantization block: the targets of RESULTS/quant/report.md."""
    path = Path(results) / "quant" / "report.md"
    if not path.exists():
        return None
    report = path.read_text()
    targets = report[report.index("## Targets") + len("## Targets"):report.index("## Perplexity")].strip()
    return (f"{README_MARKERS[0]}\n**Quantization** (issue 9; `make bench-quant`): the targets as measured (Δppl with 95% "
            "paired block-bootstrap CIs on held-out 2048-token texts; tasks on each model's usable tasks at the length "
            "shown, n as shown). "
            "Full tables and the eviction x quantization frontier: [results/quant/report.md](results/quant/report.md)."
            f"\n\n{targets}\n{README_MARKERS[1]}")

"""The KV-Direct benchmark's report, from its records alone: what a checkpoint costs per token against the KV it
replaces, bytes held as a conversation grows, and for each prompt length the token match against the full cache's
greedy output (bootstrap CIs, paired differences), bytes held and decode step time (median ratios to the full cache
in the same run)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from kvmem_bench.kvdirect import FULL
from kvmem_bench.records import read_records
from kvmem_bench.stats import bootstrap_mean, bootstrap_median, median_ratio, paired_difference

COMMAND = "make bench-kvdirect"
MIB = 2 ** 20
MIN_PAIRED = 5  # fewer paired samples: no difference is called significant (a bootstrap of 3 values says little)


def token_match(tokens: list[int], reference: list[int]) -> float:
    """The fraction of positions where the greedy tokens equal the full cache's (the paper's token match)."""
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(reference), 1)


def prefix_match(tokens: list[int], reference: list[int]) -> float:
    """The agreeing prefix, over the full cache's length: where the two outputs first part."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n / max(len(reference), 1)


def per_token_sizes(r: dict) -> dict:
    """Bytes per token and layer (float32) of a residual checkpoint and of the K/V it replaces, from the model's shape."""
    residual, kv = 4 * r["hidden_size"], 4 * 2 * r["kv_heads"] * r["head_dim"]
    return {"residual": residual, "kv": kv, "ratio": residual / kv}


def summarize(records: list[dict]) -> dict:
    """Rows of the decode table per (model, length, method), the growth curves, and the paired differences."""
    decode = [r for r in records if r["part"] == "decode"]
    full = {(r["model"], r["length"], r["sample"]): r for r in decode if r["method"] == FULL}
    by_cell: dict = defaultdict(list)
    for r in decode:
        ref = full.get((r["model"], r["length"], r["sample"]))
        if ref is not None:
            by_cell[(r["model"], r["length"], r["method"])].append((r, ref))
    rows = []
    for (model, length, method), pairs in sorted(by_cell.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        matches = [token_match(r["tokens"], ref["tokens"]) for r, ref in pairs]
        prefixes = [prefix_match(r["tokens"], ref["tokens"]) for r, ref in pairs]
        steps = [s for r, _ in pairs for s in r["step_s"]]
        full_steps = [s for _, ref in pairs for s in ref["step_s"]]
        held = [r["kv_bytes"][-1] + r["checkpoint_bytes"][-1] for r, _ in pairs]
        full_held = [ref["kv_bytes"][-1] for _, ref in pairs]
        recompute = sum(r["recompute_s"] for r, _ in pairs) / max(sum(steps), 1e-12)
        rows.append({"model": model, "length": length, "method": method, "n": len(pairs),
                     "token_match": tuple(bootstrap_mean(matches)), "prefix_match": tuple(bootstrap_mean(prefixes)),
                     "matches": matches, "samples": [r["sample"] for r, _ in pairs],
                     "held_mib": sum(held) / len(held) / MIB, "held_vs_full": sum(held) / sum(full_held),
                     "kv_mib": sum(r["kv_bytes"][-1] for r, _ in pairs) / len(pairs) / MIB,
                     "checkpoint_mib": sum(r["checkpoint_bytes"][-1] for r, _ in pairs) / len(pairs) / MIB,
                     "step_ms": tuple(1e3 * x for x in bootstrap_median(steps)),
                     "step_vs_full": median_ratio(steps, full_steps), "recompute_share": recompute,
                     "prefill_s": sum(r["prefill_s"] for r, _ in pairs) / len(pairs)})
    diffs = []
    cells = {(r["model"], r["length"], r["method"]): r for r in rows}
    for row in rows:
        if not row["method"].startswith("kv-direct"):
            continue
        for other in rows:
            if (other["model"], other["length"]) != (row["model"], row["length"]) or other["method"].startswith("kv-direct") \
                    or other["method"] == FULL:
                continue
            a = dict(zip(row["samples"], row["matches"]))
            b = dict(zip(other["samples"], other["matches"]))
            common = sorted(set(a) & set(b))
            if common:
                d = paired_difference([a[s] for s in common], [b[s] for s in common])
                diffs.append({"model": row["model"], "length": row["length"], "a": row["method"], "b": other["method"],
                              "n": len(common), "difference": tuple(d),
                              "significant": d.significant and len(common) >= MIN_PAIRED})
    # pooled over the lengths (paired by sample and length, stratified by length): more pairs than one length has
    for model, a_method in sorted({(r["model"], r["method"]) for r in rows if r["method"].startswith("kv-direct")}):
        for b_method in sorted({r["method"] for r in rows if r["model"] == model and r["method"] != FULL
                                and not r["method"].startswith("kv-direct")}):
            a, b, strata = [], [], []
            for length in sorted({r["length"] for r in rows if r["model"] == model}):
                ra, rb = cells.get((model, length, a_method)), cells.get((model, length, b_method))
                if ra is None or rb is None:
                    continue
                ma, mb = dict(zip(ra["samples"], ra["matches"])), dict(zip(rb["samples"], rb["matches"]))
                for sample in sorted(set(ma) & set(mb)):
                    a.append(ma[sample])
                    b.append(mb[sample])
                    strata.append(length)
            if len(set(strata)) > 1:
                d = paired_difference(a, b, strata)
                diffs.append({"model": model, "length": "all", "a": a_method, "b": b_method, "n": len(a),
                              "difference": tuple(d), "significant": d.significant and len(a) >= MIN_PAIRED})
    growth = [{"model": r["model"], "method": r["method"], "fed": r["fed"],
               "held_mib": [(a + b) / MIB for a, b in zip(r["kv_bytes"], r["checkpoint_bytes"])],
               "kv_mib": [a / MIB for a in r["kv_bytes"]], "checkpoint_mib": [b / MIB for b in r["checkpoint_bytes"]],
               "turn_s": r["turn_s"]} for r in records if r["part"] == "growth"]
    sizes = {}
    for r in records:
        sizes.setdefault(r["model"], per_token_sizes(r))
    commits = sorted({r["commit"] for r in records})
    return {"decode": rows, "differences": diffs, "growth": growth, "sizes": sizes, "commits": commits,
            "dirty": any(r.get("dirty") for r in records), "cells": len(cells)}


def _ci(t, digits: int = 2) -> str:
    return f"{t[0]:.{digits}f} [{t[1]:.{digits}f}, {t[2]:.{digits}f}]"


def render(s: dict) -> str:
    out = ["# KV-Direct: residual checkpoints against the full cache and eviction at the same bytes", "",
           f"Generated by `python -m kvmem_bench.kvdirect.report` from `records.jsonl` (run: `{COMMAND}`; "
           f"code at {', '.join(s['commits'])}{', with uncommitted changes' if s['dirty'] else ''}). "
           "One torch thread on a shared 2-core CPU: times are medians with bootstrap 95% CIs, and compared only as "
           "ratios within one run.", "",
           "## What a checkpoint costs", "",
           "Per token and layer, float32. `checkpoint=layer` holds each layer's input residual (hidden_size floats) for "
           "every token, `checkpoint=tokens` one int32 id a token (the stack's input; the stack runs again over the "
           "old tokens at every forward).", "",
           "| model | residual / token / layer | K+V / token / layer | residual / KV |", "|---|---|---|---|"]
    for model, z in sorted(s["sizes"].items()):
        out.append(f"| {model} | {z['residual']} B | {z['kv']} B | {z['ratio']:.2f}x |")
    if s["growth"]:
        out += ["", "## Bytes held as the conversation grows", "",
                "Fed in turns; bytes measured from the tensors after each turn (MiB; K/V window + checkpoints).", ""]
        for model in sorted({g["model"] for g in s["growth"]}):
            gs = [g for g in s["growth"] if g["model"] == model]
            fed = gs[0]["fed"]
            marks = sorted({0, len(fed) // 4, len(fed) // 2, len(fed) - 1})
            out += [f"**{model}**", "", "| method | " + " | ".join(f"{fed[i]} tok" for i in marks) + " | last turn's forward |",
                    "|---|" + "---|" * (len(marks) + 1)]
            for g in gs:
                out.append(f"| {g['method']} | " + " | ".join(f"{g['held_mib'][i]:.1f}" for i in marks)
                           + f" | {g['turn_s'][-1]:.2f} s |")
            out.append("")
        out.append("![bytes held](growth.png)")
    out += ["", "## Decoding after a long prompt", "",
            "Token match: the fraction of the 32 greedy tokens equal to the full cache's at the same position (the "
            "paper's measure), with the agreeing prefix; bytes held after the last step; the decode step's median time "
            "and its ratio to the full cache's on the same samples (the methods run one after another on a machine whose "
            "load changed over the run: ratios within a few tenths of 1 are noise); for `checkpoint=layer`, the share of "
            "step time spent recomputing K/V. n: samples (prompts from different offsets of the shipped abstracts). "
            "Eviction keeps window / length of what each layer holds: on Gemma 3 a sliding layer holds at most 511 "
            "rows, so eviction keeps about 128 there where KV-Direct keeps 256, and holds fewer bytes (the held "
            "column).", ""]
    for model in sorted({r["model"] for r in s["decode"]}):
        for length in sorted({r["length"] for r in s["decode"] if r["model"] == model}):
            rows = [r for r in s["decode"] if (r["model"], r["length"]) == (model, length)]
            out += [f"**{model}, {length}-token prompt**", "",
                    "| method | n | token match | agreeing prefix | held MiB (K/V + checkpoints) | held / full | step ms | step / full | recompute share |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for r in rows:
                out.append(f"| {r['method']} | {r['n']} | {_ci(r['token_match'])} | {_ci(r['prefix_match'])} | {r['held_mib']:.1f} "
                           f"({r['kv_mib']:.1f} + {r['checkpoint_mib']:.1f}) | {r['held_vs_full']:.2f} | "
                           f"{_ci(r['step_ms'], 0)} | {_ci(r['step_vs_full'])} | "
                           + (f"{r['recompute_share']:.2f}" if r["method"].startswith("kv-direct:checkpoint=layer") else "–")
                           + " |")
            out.append("")
    if s["differences"]:
        out += ["Paired differences in token match (KV-Direct minus eviction, same samples; significant: the 95% CI "
                f"excludes 0, with at least {MIN_PAIRED} samples; length `all`: every length's pairs, stratified by length):", "", "| model | length | KV-Direct | eviction | n | difference | significant |",
                "|---|---|---|---|---|---|---|"]
        for d in s["differences"]:
            out.append(f"| {d['model']} | {d['length']} | {d['a']} | {d['b']} | {d['n']} | {_ci(d['difference'])} | "
                       f"{'yes' if d['significant'] else 'no' if d['n'] >= MIN_PAIRED else f'n < {MIN_PAIRED}: not tested'} |")
        out += ["", "![token match and bytes](decode.png)"]
    return "\n".join(out) + "\n"


def plot(s: dict, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if s["growth"]:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for g in s["growth"]:
            ax.plot(g["fed"], g["held_mib"], marker="o", ms=3, label=f"{g['model']} {g['method']}")
        ax.set_xlabel("tokens fed")
        ax.set_ylabel("MiB held (K/V + checkpoints)")
        ax.set_title("Bytes held as the conversation grows")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "growth.png", dpi=110)
        plt.close(fig)
    if s["decode"]:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
        models = sorted({r["model"] for r in s["decode"]})
        for k, method in enumerate(sorted({r["method"] for r in s["decode"]})):
            for model in models:
                rs = sorted((r for r in s["decode"] if (r["model"], r["method"]) == (model, method)), key=lambda r: r["length"])
                if not rs:
                    continue
                label = method + (f" ({model})" if len(models) > 1 else "")
                x = [r["length"] * (1 + 0.015 * (k - 3)) for r in rs]  # methods side by side at each length
                axes[0].errorbar(x, [r["token_match"][0] for r in rs],
                                 yerr=[[r["token_match"][0] - r["token_match"][1] for r in rs],
                                       [r["token_match"][2] - r["token_match"][0] for r in rs]],
                                 marker="o", ms=4, capsize=2, label=label)
                axes[1].plot(x, [r["held_mib"] for r in rs], marker="o", ms=4, label=label)
                axes[2].errorbar(x, [r["step_vs_full"][0] for r in rs],
                                 yerr=[[r["step_vs_full"][0] - r["step_vs_full"][1] for r in rs],
                                       [r["step_vs_full"][2] - r["step_vs_full"][0] for r in rs]],
                                 marker="o", ms=4, capsize=2, label=label)
        for ax, title, ylabel in zip(axes, ("Token match with the full cache", "Bytes held after the last step",
                                            "Decode step time / full cache's"),
                                     ("token match (95% CI)", "MiB (K/V + checkpoints)", "ratio of medians (95% CI)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_title(title)
            ax.set_ylabel(ylabel)
        axes[1].set_yscale("log")
        axes[2].set_yscale("log")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "decode.png", dpi=110)
        plt.close(fig)


def write_report(folder: Path) -> Path:
    folder = Path(folder)
    s = summarize(read_records(folder / "records.jsonl"))
    (folder / "results.json").write_text(json.dumps({k: v for k, v in s.items()}, indent=1) + "\n")
    plot(s, folder)
    path = folder / "report.md"
    path.write_text(render(s))
    return path


if __name__ == "__main__":
    import sys

    print(write_report(Path(sys.argv[1] if len(sys.argv) > 1 else "results/kvdirect")))

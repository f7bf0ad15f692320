"""The race against kvpress in the long-context report: kvmem's best against kvpress's best per keep ratio, paired
on the samples both ran, with the bytes each holds; issue 8's targets; the score-against-bytes plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvmem_bench.longctx.scores import (MEAN, RACE_MIN_SAMPLES, SETTINGS, SHARED, Scores, fmt_interval, mib,  # noqa: E402
                                        paired)
from kvmem_bench.stats import Interval, bootstrap_mean  # noqa: E402


def race_bests(kvmem_rows: list[dict], press_rows: list[dict], kvmem: Scores, press: Scores,
               usable: dict[tuple, list[str]], setting: str = "agnostic") -> list[dict]:
    """Per model x length x keep ratio kvpress ran (in one setting): kvmem's best and kvpress's best summary rows
    (each among cells with at least RACE_MIN_SAMPLES samples; kvmem's on every sample the suite has) and their
    paired difference (kvmem - kvpress) on the `common` samples both ran."""
    k_index = {(r["model"], r["length"], r["method"], r["keep_ratio"]): r for r in kvmem_rows
               if r["task"] == MEAN and r["setting"] == setting}
    p_index = {(r["model"], r["length"], r["method"], r["keep_ratio"]): r for r in press_rows
               if r["task"] == MEAN and r["setting"] == setting}
    out = []
    for model, length in sorted({k[:2] for k in p_index}):
        tasks = set(usable.get((model, length), []))
        for ratio in sorted({k[3] for k in p_index if k[:2] == (model, length) and k[3] < 1.0}, reverse=True):
            kb = [r for k, r in k_index.items() if k[:2] == (model, length) and k[3] == ratio
                  and r["n"] >= RACE_MIN_SAMPLES and r["complete"]]
            pb = [r for k, r in p_index.items() if k[:2] == (model, length) and k[3] == ratio and r["n"] >= RACE_MIN_SAMPLES]
            if not kb or not pb:
                continue
            kbest, pbest = max(kb, key=lambda r: r["score"]), max(pb, key=lambda r: r["score"])
            a = kvmem.samples(model, length, setting, kbest["method"], ratio, tasks)
            b = press.samples(model, length, setting, pbest["method"], ratio, tasks)
            out.append(dict(model=model, length=length, keep_ratio=ratio, kvmem=kbest, kvpress=pbest,
                            diff=paired(a, b), common=len(set(a) & set(b))))
    return out


def race_tables(kvmem_rows: list[dict], press_rows: list[dict], kvmem: Scores, press: Scores,
                usable: dict[tuple, list[str]], fidelity: bool = True, setting: str = "agnostic") -> list[str]:
    """Per model x length x keep ratio (in one setting): kvmem's best against kvpress's best, the paired
    difference, and bytes held; then the fidelity check of the methods both libraries have."""
    p_index = {(r["model"], r["length"], r["method"], r["keep_ratio"]): r for r in press_rows
               if r["task"] == MEAN and r["setting"] == setting}
    keys = sorted({k[:2] for k in p_index})
    if not keys:
        return [f"No kvpress records in the {setting} setting yet: run `make race`.", ""]
    lines = ["| model @ length | keep | kvmem best | KV MiB held | kvpress best | KV MiB held | kvmem − kvpress (paired) |",
             "|---|---|---|---|---|---|---|"]
    for b in race_bests(kvmem_rows, press_rows, kvmem, press, usable, setting):
        kbest, pbest, diff = b["kvmem"], b["kvpress"], b["diff"]
        verdict = "–" if diff is None else fmt_interval(diff) + f" n={b['common']}" + (
            " (significant)" if diff.significant else " (not significant)")
        lines.append(f"| {b['model']} @ {b['length']} | {b['keep_ratio']:g} | {kbest['method']}: {fmt_interval(_iv(kbest))} "
                     f"n={kbest['n']} | {mib(kbest['kv_bytes'])} | {pbest['method']}: {fmt_interval(_iv(pbest))} n={pbest['n']} | "
                     f"{mib(pbest['kv_bytes'])} | {verdict} |")
    if not fidelity:
        return lines + [""]
    lines += ["", f"### Fidelity: the methods both libraries have ({setting}; paired difference kvmem − kvpress)", "",
              "| model @ length | kvmem method | kvpress press | keep | kvmem | kvpress | difference | agree |",
              "|---|---|---|---|---|---|---|---|"]
    for model, length in keys:
        tasks = set(usable.get((model, length), []))
        for ratio in [1.0] + sorted({k[3] for k in p_index if k[:2] == (model, length) and k[3] < 1.0}, reverse=True):
            pairs = [("full", "full")] if ratio >= 1.0 else SHARED.items()
            for ours, theirs in pairs:
                a = kvmem.samples(model, length, setting, ours, ratio, tasks)
                b = press.samples(model, length, setting, theirs, ratio, tasks)
                diff = paired(a, b)
                if diff is None:
                    continue
                common = sorted(set(a) & set(b))  # both scores on the samples the difference is taken on
                ka, kb_ = (bootstrap_mean([x[k]["score"] for k in common], strata=[k[0] for k in common]) for x in (a, b))
                lines.append(f"| {model} @ {length} | {ours} | {theirs} | {ratio:g} | {fmt_interval(ka)} | {fmt_interval(kb_)} | "
                             f"{fmt_interval(diff)} n={len(common)} | {'no' if diff.significant else 'yes'} |")
    lines.append("")
    return lines


AGNOSTIC_TARGET = (0.25, 0.9)  # issue 8: agnostic at keep 0.25 keeps >= 90 % of the full-cache score
RACE_TARGET_RATIOS = (0.25, 0.1)  # issue 8: kvmem's best >= kvpress's best there, with fewer bytes held
FEWER_BYTES = 0.01  # "fewer bytes" means at least this fraction fewer


def quantized_alternative(quant: list[dict], press: Scores, best: dict, setting: str, tasks: set[str]) -> dict | None:
    """A kvmem method at this keep ratio with a quantization scheme on top (the quant suite's task records: the same
    samples, in the same setting, each cell compressing then quantizing its own copy), against kvpress's best on the
    samples both ran. Any method the quant suite ran counts, not only the best of the eviction table (a variant that
    became the best after its quant runs has none yet); the pair with the highest score is taken (fewer bytes breaks
    ties); None when there is none to pair on samples of every usable task."""
    p = best["kvpress"]
    cells: dict[tuple[str, str], dict[tuple, dict]] = defaultdict(dict)
    for r in quant:
        if r.get("part") != "tasks" or r["scheme"] == "full" or r["scheme"].startswith("hf-"):  # hf-*: transformers' caches
            continue
        if r.get("setting", "agnostic") != setting:  # records before the quant suite ran aware were all agnostic
            continue
        if (r["model"], r["length"], r["keep_ratio"]) == (best["model"], best["length"], best["keep_ratio"]) \
                and r["task"] in tasks:
            cells[(r["method"], r["scheme"])][(r["task"], r["sample"])] = r
    theirs = press.samples(best["model"], best["length"], setting, p["method"], best["keep_ratio"], tasks)
    options = []
    for (method, scheme), ours in cells.items():
        common = sorted(set(ours) & set(theirs))
        diff = paired(ours, theirs)
        if diff is None or {c[0] for c in common} != tasks:  # a run stopped before every usable task: another mix
            continue
        options.append(dict(method=method, scheme=scheme, diff=diff, common=len(common),
                            score=statistics.fmean(ours[c]["score"] for c in common),
                            kv_bytes=statistics.fmean(ours[c]["kv_bytes"] for c in common),
                            press_bytes=statistics.fmean(theirs[c]["kv_bytes"] for c in common)))
    return max(options, key=lambda o: (o["score"], -o["kv_bytes"])) if options else None


def target_lines(kvmem_rows: list[dict], press_rows: list[dict], kvmem: Scores, press: Scores,
                 usable: dict[tuple, list[str]], quant: list[dict] = ()) -> list[str]:
    """The query-agnostic targets, each judged per model x length from the rows the tables show. A race cell that
    kvmem's best does not meet alone may be met by that method with quantization on top (`quant`: the quant
    suite's task records), said so on its line."""
    keep, share = AGNOSTIC_TARGET
    index = {(r["model"], r["length"], r["method"], r["keep_ratio"]): r for r in kvmem_rows
             if r["task"] == MEAN and r["setting"] == "agnostic"}
    lines, met = [], defaultdict(list)
    for model, length in sorted(usable):
        best = [r for k, r in index.items() if k[:2] == (model, length) and k[3] == keep and r["best"]]
        full = index.get((model, length, "full", 1.0))
        if not best or not full or not full["score"]:
            continue
        b = best[0]
        ok = b["score"] >= share * full["score"]
        met[model].append(ok)
        lines.append(f"  - {model} @ {length}: {b['method']} {fmt_interval(_iv(b))} against the full cache's {full['score']:.2f}: "
                     f"{b['score'] / full['score']:.0%} ({'met' if ok else 'not met'})")
    head = [f"* **Agnostic at keep {keep:g} keeps >= {share:.0%} of the full-cache score** (the column's best, by its "
            "point estimate): " + "; ".join(f"{m}: {'met' if all(v) else 'not met'}" for m, v in sorted(met.items()))]
    race, total = [], 0
    for setting in race_settings(press_rows):
        for b in race_bests(kvmem_rows, press_rows, kvmem, press, usable, setting):
            if b["keep_ratio"] not in RACE_TARGET_RATIOS or b["diff"] is None:
                continue
            k, p, d = b["kvmem"], b["kvpress"], b["diff"]
            fewer = k["kv_bytes"] < (1 - FEWER_BYTES) * p["kv_bytes"]  # not a rounding difference of a few rows
            ok = d.estimate >= 0 and fewer
            why = "" if ok else " (" + ", ".join(x for x in ("kvmem's best scores lower" if d.estimate < 0 else "",
                                                          "not fewer bytes" if not fewer else "") if x) + ")"
            line = (f"  - {b['model']} @ {b['length']} {setting} {b['keep_ratio']:g}: {k['method']} − {p['method']} "
                    f"{fmt_interval(d)} n={b['common']} ({'significant' if d.significant else 'not significant'}), "
                    f"{mib(k['kv_bytes'])} against {mib(p['kv_bytes'])} MiB: {'met' if ok else 'not met'}{why}")
            q = None if ok else quantized_alternative(quant, press, b, setting, set(usable.get((b["model"], b["length"]), [])))
            if q:
                q_ok = q["diff"].estimate >= 0 and q["kv_bytes"] < (1 - FEWER_BYTES) * q["press_bytes"]
                ok = q_ok
                of = "" if q["method"] == b["kvmem"]["method"] else f" of {q['method']}"
                line += (f"; with {q['scheme']} on top{of} (results/quant, n={q['common']}): {fmt_interval(q['diff'])} "
                         f"({'significant' if q['diff'].significant else 'not significant'}), {mib(q['kv_bytes'])} "
                         f"against {mib(q['press_bytes'])} MiB: {'met' if q_ok else 'not met'}")
            total += ok
            race.append(line)
    if race:
        head.append(f"* **kvmem's best >= kvpress's best at keep {' and '.join(f'{r:g}' for r in RACE_TARGET_RATIOS)}, "
                    f"with fewer bytes held** (paired estimate >= 0; bytes at least {FEWER_BYTES:.0%} fewer): met in "
                    f"{total} of {len(race)} (model, length, "
                    "setting, keep) cells" + (", counting kvmem's best-scoring method with quantization on top (results/quant) "
                                              "where its best alone does not meet it"
                                              if quant else ""))
    return [*(head[:1] + lines if met else []), *head[1:], *race, ""]  # no usable task: no share to judge


def race_settings(press_rows: list[dict]) -> list[str]:
    """The settings kvpress has records in, agnostic first (always listed: its table says when it has none)."""
    return [s for s in SETTINGS if s == "agnostic" or any(r["setting"] == s for r in press_rows)]


def _iv(row: dict) -> Interval:
    return Interval(row["score"], row["lo"], row["hi"])


def pareto_plot(kvmem_rows: list[dict], press_rows: list[dict], out: Path) -> Path | None:
    """Score against KV bytes held (agnostic, mean over usable tasks), one panel per model x length."""
    keys = sorted({(r["model"], r["length"]) for r in press_rows})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, (model, length) in zip(axes[0], keys):
        for rows, marker, prefix in ((kvmem_rows, "o", "kvmem "), (press_rows, "x", "kvpress ")):
            series = defaultdict(list)
            for r in rows:
                if (r["model"], r["length"], r["task"], r["setting"]) == (model, length, MEAN, "agnostic"):
                    series[r["method"]].append(r)
            for method, rs in sorted(series.items()):
                rs.sort(key=lambda r: r["kv_bytes"])
                ax.plot([r["kv_bytes"] / 2**20 for r in rs], [r["score"] for r in rs], marker=marker,
                        linestyle="-" if marker == "o" else ":", label=prefix + method)
        ax.set_title(f"{model} @ {length}: agnostic")
        ax.set_xlabel("KV MiB held (measured)")
        ax.set_ylabel("mean score, usable tasks")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)  # per panel: each panel has its own set of runnable presses and colours
    path = out / "race_pareto.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

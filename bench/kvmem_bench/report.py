"""Report of the long-context benchmark: scores with bootstrap CIs, paired comparisons, the race against
kvpress, speed and memory.

Everything is computed from per-sample records (`records.jsonl`: one line per model x length x task x
sample x setting x method x keep ratio), so every number carries its sample count and 95% interval:

* A task counts for a model and length when its full-cache score is >= FULL_CACHE_MIN; the rest are
  flagged and left out of every average.
* A headline cell is the mean over the usable tasks (each task weighs the same) with a stratified
  bootstrap CI (`kvmem_bench.stats`).
* "A beats B" is only said from a paired comparison on the same samples whose interval excludes 0. In
  each column the best method is bold; a cell marked ▼ is significantly below it; unmarked cells are
  not distinguishable from the best at this sample size.

`results.json` holds the summary rows (one per model x length x task-or-mean x setting x library x
method x keep ratio). The race (`results/race/records.jsonl`, kvpress's presses on the same prompts)
and the speed benchmark (`results/speed/results.json`) are included when present.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvmem_bench.stats import Interval, bootstrap_mean, paired_difference  # noqa: E402

FULL_CACHE_MIN = 0.8  # a task whose full-cache score is below this measures nothing about compression
RACE_MIN_SAMPLES = 30  # fewer answers than this (a press run on a subset so far) cannot be a race's best
PAIRED_MIN_SAMPLES = 10  # no paired difference (no ▼/▲, no fidelity verdict) from fewer common samples
MEAN = "mean"  # the task name of rows averaged over the usable tasks
SETTINGS = ("agnostic", "aware")
SHARED = {"random": "random", "streaming-llm": "streaming-llm", "snapkv": "snapkv", "tova": "tova",
          "knorm": "knorm", "h2o": "observed-attention"}  # kvmem method -> the kvpress press that does the same
WALL_GOAL_H = 4.0  # the headline suite, and the race, should each run within this on the 2 cores
FIRST_METHODS = ("full", "h2o", "knorm", "random", "snapkv", "streaming-llm", "tova")  # the suite the goal was set for
FIRST_PRESSES = ("full", *(SHARED[m] for m in FIRST_METHODS if m in SHARED))  # kvpress's side of it
BENCH_COMMANDS_NOTE = "See the Makefile's `bench` and `race` targets for the exact commands."


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _fmt(iv: Interval, digits: int = 2) -> str:
    return f"{iv.estimate:.{digits}f} [{iv.lo:.{digits}f}, {iv.hi:.{digits}f}]"


class Scores:
    """Per-sample scores of one library's records, indexed for the cells of a report."""

    def __init__(self, records: list[dict]):
        self.by_cell: dict[tuple, dict[tuple, dict]] = defaultdict(dict)  # (model, L, setting, method, ratio) -> (task, sample) -> record
        for r in records:
            if r["task"].startswith("ppl-"):
                continue
            self.by_cell[(r["model"], r["length"], r["setting"], r["method"], r["keep_ratio"])][(r["task"], r["sample"])] = r

    def keys(self) -> set[tuple]:
        return set(self.by_cell)

    def samples(self, model, length, setting, method, ratio, tasks) -> dict[tuple, dict]:
        if ratio >= 1.0:
            method = "full"  # keep ratio 1.0 is the full cache, whatever the method
        cell = self.by_cell.get((model, length, setting, method, ratio), {})
        return {k: r for k, r in cell.items() if k[0] in tasks}

    def interval(self, model, length, setting, method, ratio, tasks) -> tuple[Interval, int] | None:
        cell = self.samples(model, length, setting, method, ratio, tasks)
        if not cell:
            return None
        keys = sorted(cell)
        return bootstrap_mean([cell[k]["score"] for k in keys], strata=[k[0] for k in keys]), len(keys)

    def methods(self, model, length) -> list[str]:
        return list(dict.fromkeys(k[3] for k in self.by_cell if k[:2] == (model, length) and k[3] != "full"))

    def ratios(self, model, length) -> list[float]:
        return sorted({k[4] for k in self.by_cell if k[:2] == (model, length) and k[4] < 1.0}, reverse=True)


def paired(a: dict[tuple, dict], b: dict[tuple, dict]) -> Interval | None:
    """Paired difference mean(a - b) on the samples both have, stratified by task; None below PAIRED_MIN_SAMPLES
    (a bootstrap of a handful of 0/1 scores gives a zero-width interval: "significant" from noise)."""
    keys = sorted(set(a) & set(b))
    if len(keys) < PAIRED_MIN_SAMPLES:
        return None
    return paired_difference([a[k]["score"] for k in keys], [b[k]["score"] for k in keys], strata=[k[0] for k in keys])


def full_cache(scores: Scores) -> dict[tuple, dict[str, tuple[Interval, int]]]:
    """Full-cache score (agnostic prompt) per (model, length) and task."""
    out: dict[tuple, dict] = defaultdict(dict)
    for (model, length, setting, method, ratio), cell in scores.by_cell.items():
        if method == "full" and setting == "agnostic":
            for task in sorted({k[0] for k in cell}):
                out[(model, length)][task] = scores.interval(model, length, setting, method, ratio, {task})
    return out


def usable_tasks(full: dict) -> dict[tuple, list[str]]:
    return {key: sorted(t for t, (iv, _) in tasks.items() if iv.estimate >= FULL_CACHE_MIN) for key, tasks in full.items()}


def summary_rows(scores: Scores, usable: dict[tuple, list[str]], library: str = "kvmem") -> list[dict]:
    """results.json rows: per model x length x (each task, and the mean over usable tasks) x setting x
    method x ratio: score with CI, n, measured KV bytes, and whether it is significantly below the
    column's best (paired, same samples)."""
    rows = []
    for (model, length), tasks in sorted(usable.items()):
        ratios = [1.0] + scores.ratios(model, length)
        for setting in SETTINGS:
            for ratio in ratios:
                methods = ["full"] if ratio >= 1.0 else scores.methods(model, length)
                for group in [MEAN] + tasks:
                    chosen = set(tasks) if group == MEAN else {group}
                    if not chosen:
                        continue
                    cells = {m: scores.samples(model, length, setting, m, ratio, chosen) for m in methods}
                    cells = {m: c for m, c in cells.items() if c}
                    if not cells:
                        continue
                    ivs = {m: scores.interval(model, length, setting, m, ratio, chosen) for m in cells}
                    # a method run on fewer samples than the full cache (added later, still running) is shown
                    # with its n and compared paired, but cannot be the column's best
                    every = set(scores.samples(model, length, setting, "full", 1.0, chosen))
                    complete = {m for m, c in cells.items() if set(c) >= every}
                    # ties go to the method listed first (a set's order changes with the hash seed)
                    best = max([m for m in cells if m in complete] or list(cells), key=lambda m: ivs[m][0].estimate)
                    for m, cell in cells.items():
                        iv, n = ivs[m]
                        below = paired(cells[best], cell) if m != best else None
                        recs = list(cell.values())
                        rows.append(dict(
                            library=library, model=model, length=length, task=group, setting=setting, method=m,
                            keep_ratio=ratio, score=iv.estimate, lo=iv.lo, hi=iv.hi, n=n,
                            below_best=bool(below and below.significant and below.estimate > 0),
                            above_best=bool(below and below.significant and below.estimate < 0),  # a partial method
                            best=m == best and m in complete,
                            complete=m in complete,
                            kv_bytes=round(sum(r["kv_bytes"] for r in recs) / len(recs)),
                            kv_bytes_full=round(sum(r["kv_bytes_full"] for r in recs) / len(recs)),
                            fraction_kept=sum(r["kv_bytes"] / r["kv_bytes_full"] for r in recs) / len(recs),
                        ))
    return rows


def _cell_text(row: dict | None, digits: int = 2) -> str:
    if row is None:
        return "–"
    text = f"{row['score']:.{digits}f} [{row['lo']:.{digits}f}, {row['hi']:.{digits}f}]"
    if row["best"]:
        return f"**{text}**"
    partial = "" if row.get("complete", True) else f" (n={row['n']})"
    return text + partial + (" ▼" if row["below_best"] else " ▲" if row.get("above_best") else "")


def headline(rows: list[dict], usable: dict[tuple, list[str]], full: dict) -> list[str]:
    """One table per model and length: methods x (setting, keep ratio), mean over the usable tasks."""
    lines = []
    index = {(r["model"], r["length"], r["setting"], r["method"], r["keep_ratio"]): r
             for r in rows if r["task"] == MEAN and r["library"] == "kvmem"}
    for (model, length), tasks in sorted(usable.items()):
        ratios = sorted({k[4] for k in index if k[:2] == (model, length) and k[4] < 1.0}, reverse=True)
        methods = list(dict.fromkeys(k[3] for k in index if k[:2] == (model, length) and k[3] != "full"))
        flagged = [f"{t} ({iv.estimate:.2f})" for t, (iv, _) in sorted(full[(model, length)].items()) if t not in tasks]
        n = index.get((model, length, "agnostic", "full", 1.0), {}).get("n", 0)
        lines += [f"**{model} @ {length} tokens** — {len(tasks)} usable tasks ({', '.join(tasks) or 'none'}), "
                  f"{n} samples per cell" + (f"; flagged (full cache < {FULL_CACHE_MIN}): {', '.join(flagged)}" if flagged else ""), ""]
        if not tasks or not ratios:
            lines += ["No usable task here: nothing to compare.", ""]
            continue
        cols = [(s, k) for s in SETTINGS for k in ratios]
        lines += ["| method | " + " | ".join(f"{s} {k:g}" for s, k in cols) + " |", "|---|" + "---|" * len(cols)]
        full_row = index.get((model, length, "agnostic", "full", 1.0))
        lines.append("| full cache (1.0) | " + " | ".join(_cell_text(full_row).strip("*") for _ in cols) + " |")
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(_cell_text(index.get((model, length, s, m, k))) for s, k in cols) + " |")
        lines.append("")
    return lines


# --- the race against kvpress -------------------------------------------------------------------


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
        verdict = "–" if diff is None else _fmt(diff) + f" n={b['common']}" + (
            " (significant)" if diff.significant else " (not significant)")
        lines.append(f"| {b['model']} @ {b['length']} | {b['keep_ratio']:g} | {kbest['method']}: {_fmt(_iv(kbest))} "
                     f"n={kbest['n']} | {_mib(kbest['kv_bytes'])} | {pbest['method']}: {_fmt(_iv(pbest))} n={pbest['n']} | "
                     f"{_mib(pbest['kv_bytes'])} | {verdict} |")
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
                lines.append(f"| {model} @ {length} | {ours} | {theirs} | {ratio:g} | {_fmt(ka)} | {_fmt(kb_)} | "
                             f"{_fmt(diff)} n={len(common)} | {'no' if diff.significant else 'yes'} |")
    lines.append("")
    return lines


AGNOSTIC_TARGET = (0.25, 0.9)  # issue 8: agnostic at keep 0.25 keeps >= 90 % of the full-cache score
RACE_TARGET_RATIOS = (0.25, 0.1)  # issue 8: kvmem's best >= kvpress's best there, with fewer bytes held
FEWER_BYTES = 0.01  # "fewer bytes" means at least this fraction fewer


def quantized_alternative(quant: list[dict], press: Scores, best: dict, setting: str, tasks: set[str]) -> dict | None:
    """kvmem's best race method with a quantization scheme on top (the quant suite's task records: the same samples,
    agnostic, each cell compressing then quantizing its own copy), against kvpress's best on the samples both ran.
    The scheme with the highest score is taken (fewer bytes breaks ties); None when there is none to pair on samples
    of every usable task."""
    k, p = best["kvmem"], best["kvpress"]
    if setting != "agnostic":  # the quant suite runs the agnostic setting only
        return None
    cells: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for r in quant:
        if r.get("part") != "tasks" or r["scheme"] == "full" or r["scheme"].startswith("hf-"):  # hf-*: transformers' caches
            continue
        if (r["model"], r["length"], r["method"], r["keep_ratio"]) == (best["model"], best["length"], k["method"],
                                                                      best["keep_ratio"]) and r["task"] in tasks:
            cells[r["scheme"]][(r["task"], r["sample"])] = r
    theirs = press.samples(best["model"], best["length"], setting, p["method"], best["keep_ratio"], tasks)
    options = []
    for scheme, ours in cells.items():
        common = sorted(set(ours) & set(theirs))
        diff = paired(ours, theirs)
        if diff is None or {c[0] for c in common} != tasks:  # a run stopped before every usable task: another mix
            continue
        options.append(dict(scheme=scheme, diff=diff, common=len(common),
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
        lines.append(f"  - {model} @ {length}: {b['method']} {_fmt(_iv(b))} against the full cache's {full['score']:.2f}: "
                     f"{b['score'] / full['score']:.0%} ({'met' if ok else 'not met'})")
    head = [f"* **Agnostic at keep {keep:g} keeps >= {share:.0%} of the full-cache score** (the column's best, by its "
            "point estimate): " + "; ".join(f"{m}: {'met' if all(v) else 'not met'}" for m, v in sorted(met.items()))]
    race, total = [], 0
    for setting in _race_settings(press_rows):
        for b in race_bests(kvmem_rows, press_rows, kvmem, press, usable, setting):
            if b["keep_ratio"] not in RACE_TARGET_RATIOS or b["diff"] is None:
                continue
            k, p, d = b["kvmem"], b["kvpress"], b["diff"]
            fewer = k["kv_bytes"] < (1 - FEWER_BYTES) * p["kv_bytes"]  # not a rounding difference of a few rows
            ok = d.estimate >= 0 and fewer
            why = "" if ok else " (" + ", ".join(x for x in ("kvmem's best scores lower" if d.estimate < 0 else "",
                                                          "not fewer bytes" if not fewer else "") if x) + ")"
            line = (f"  - {b['model']} @ {b['length']} {setting} {b['keep_ratio']:g}: {k['method']} − {p['method']} "
                    f"{_fmt(d)} n={b['common']} ({'significant' if d.significant else 'not significant'}), "
                    f"{_mib(k['kv_bytes'])} against {_mib(p['kv_bytes'])} MiB: {'met' if ok else 'not met'}{why}")
            q = None if ok else quantized_alternative(quant, press, b, setting, set(usable.get((b["model"], b["length"]), [])))
            if q:
                q_ok = q["diff"].estimate >= 0 and q["kv_bytes"] < (1 - FEWER_BYTES) * q["press_bytes"]
                ok = q_ok
                line += (f"; with {q['scheme']} on top (results/quant, n={q['common']}): {_fmt(q['diff'])} "
                         f"({'significant' if q['diff'].significant else 'not significant'}), {_mib(q['kv_bytes'])} "
                         f"against {_mib(q['press_bytes'])} MiB: {'met' if q_ok else 'not met'}")
            total += ok
            race.append(line)
    if race:
        head.append(f"* **kvmem's best >= kvpress's best at keep {' and '.join(f'{r:g}' for r in RACE_TARGET_RATIOS)}, "
                    f"with fewer bytes held** (paired estimate >= 0; bytes at least {FEWER_BYTES:.0%} fewer): met in "
                    f"{total} of {len(race)} (model, length, "
                    "setting, keep) cells" + (", counting kvmem's best with its best-scoring quantization on top (results/quant) "
                                              "where it alone does not meet it"
                                              if quant else ""))
    return [*(head[:1] + lines if met else []), *head[1:], *race, ""]  # no usable task: no share to judge


def _race_settings(press_rows: list[dict]) -> list[str]:
    """The settings kvpress has records in, agnostic first (always listed: its table says when it has none)."""
    return [s for s in SETTINGS if s == "agnostic" or any(r["setting"] == s for r in press_rows)]


def _iv(row: dict) -> Interval:
    return Interval(row["score"], row["lo"], row["hi"])


def _pareto_plot(kvmem_rows: list[dict], press_rows: list[dict], out: Path) -> Path | None:
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


# --- plots and the report ------------------------------------------------------------------------


def _plot(rows: list[dict], model: str, length: int, out: Path) -> Path | None:
    """Score (95% CI bars) vs measured fraction of KV bytes kept, per method: agnostic and aware."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    drawn = False
    for ax, setting in zip(axes, SETTINGS):
        series = defaultdict(list)
        for r in rows:
            if (r["library"], r["model"], r["length"], r["task"], r["setting"]) == ("kvmem", model, length, MEAN, setting) \
                    and r["method"] != "full":
                series[r["method"]].append(r)
        for method, rs in series.items():
            rs.sort(key=lambda r: r["fraction_kept"])
            ax.errorbar([r["fraction_kept"] for r in rs], [r["score"] for r in rs],
                        yerr=[[r["score"] - r["lo"] for r in rs], [r["hi"] - r["score"] for r in rs]],
                        marker="o", capsize=3, label=method)
            drawn = True
        ax.set_title(f"{model} @ {length}: {setting}")
        ax.set_xlabel("fraction of KV bytes kept (measured)")
        ax.set_ylabel("mean score over usable tasks (95% CI)")
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
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


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


EAGER_PRESSES = {"observed-attention"}  # kvpress_runner.EAGER: prefilled again with eager attention


def _costs(rows: list[dict]) -> tuple[dict[tuple, list[float]], dict[tuple, dict[tuple, float]]]:
    """Process seconds, attributed: the prefill times recorded per prefilled sample (kvmem's settings share one
    prefill; kvpress prefills each setting apart), and per (model, length, task, setting, method) the seconds of
    each sample: compression, its share of a batch of answers (kvmem's are batched), and a kvpress press once
    per sample (a scoring shared by its ratios, KVzip's replay, is on each of their records), with the eager
    prefill observed-attention needs (kvpress_runner.EAGER) charged to that press."""
    prefills: dict[tuple, list[float]] = defaultdict(list)
    per_key: dict[tuple, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
    once: dict[tuple, float] = {}  # (key, sample) -> the seconds a kvpress press costs a sample once
    for r in rows:
        kvpress = r.get("library") == "kvpress"
        sample = (r["model"], r["length"], r["task"], r["sample"], r["setting"] if kvpress else None)
        key = (r["model"], r["length"], r["task"], r["setting"], r["method"])
        if kvpress and r["method"] in EAGER_PRESSES:
            once[(key, sample, "prefill")] = max(once.get((key, sample, "prefill"), 0.0), r.get("prefill_s", 0.0))
        else:
            prefills[sample].append(r.get("prefill_s", 0.0))
        once[(key, sample, "press")] = max(once.get((key, sample, "press"), 0.0), r.get("press_s", 0.0))
        per_key[key][sample[:4]] += r.get("compress_s", 0.0) + r.get("answer_s", 0.0) / max(r.get("batch", 1), 1)
    for (key, sample, _), seconds in once.items():
        per_key[key][sample[:4]] += seconds
    return prefills, per_key


def spent(rows: list[dict], fresh: bool = False) -> tuple[float, dict[str, float]]:
    """Process seconds of prefills, and per method of compression and answers (`_costs`). A sample prefilled
    again by a later run counts again, unless `fresh` (what one run from scratch would take: the median of its
    recorded prefills, once)."""
    prefills, per_key = _costs(rows)
    per_method: dict[str, float] = defaultdict(float)
    for key, by_sample in per_key.items():
        per_method[key[-1]] += sum(by_sample.values())
    return sum(_prefill(times, fresh) for times in prefills.values()), dict(per_method)


def _prefill(times: list[float], fresh: bool) -> float:
    """One prefilled sample's seconds: every recorded prefill, or what one fresh run takes (their median)."""
    return statistics.median(set(times)) if fresh else sum(set(times))


def projected(rows: list[dict], samples: dict[tuple, int], expected: set[tuple[str, str]] | None = None,
              not_runnable: set[tuple[str, str]] = frozenset(),
              first: dict[str, int] | None = None) -> tuple[float, dict[str, float], int, list[str]]:
    """What running `rows`' methods on `samples` ((model, length, task) -> sample count) would take from
    scratch, each part priced per sample from the samples that ran it (`_costs`): the mean fresh prefill of a
    task's samples, and of every (setting, method) `expected` (default: those in `rows`), its mean over the
    task's samples that ran it.
    Returns (prefills, per method, the fewest samples a price came from, what no sample ran so could not be
    priced: "method (setting): model @ length" with its task count). A (model, method) in `not_runnable`
    (the library fails there) is not expected; a method in `first` runs on only that many samples a task."""
    prefills, per_key = _costs(rows)
    pairs = sorted(expected if expected is not None else {key[3:] for key in per_key})  # (setting, method)
    prefill, per_method, fewest, missing = 0.0, defaultdict(float), None, Counter()
    for task, n in sorted(samples.items()):
        mine: dict[tuple, float] = defaultdict(float)  # sample -> its prefills (kvpress: one per setting)
        for sample, times in prefills.items():
            if sample[:3] == task:
                mine[sample[:4]] += _prefill(times, True)
        if not mine:
            missing[f"every method: {task[0]} @ {task[1]}"] += 1
            continue
        prefill += n * statistics.mean(mine.values())
        for setting, method in pairs:
            by_sample = per_key.get((*task, setting, method))
            if by_sample:
                per_method[method] += min(n, (first or {}).get(method, n)) * statistics.mean(by_sample.values())
                fewest = len(by_sample) if fewest is None else min(fewest, len(by_sample))
            elif (task[0], method) not in not_runnable:
                missing[f"{method} ({setting}): {task[0]} @ {task[1]}"] += 1
    return prefill, dict(per_method), fewest or 0, [f"{what} ({n} task{'s' * (n > 1)})" for what, n in missing.items()]


def cost_lines(records: list[dict], runs: list[dict], label: str, usable: dict[tuple, list[str]],
               samples: dict[tuple, int], parts: dict[str, Callable[[dict], bool]], timing: list[dict] | None = None,
               timing_label: str = "", not_runnable: set[tuple[str, str]] = frozenset(),
               first: dict[str, int] | None = None) -> list[str]:
    """Compute spent (`spent`), and elapsed wall clock of the runs (union of their intervals, so two
    processes running side by side count once). Then the headline suite from scratch (usable tasks, each with
    its `samples`) against WALL_GOAL_H on two 1-thread processes, for every method and for each of `parts`
    (a name -> which records it keeps: methods, settings), priced per sample by `timing` (a run of the current
    code; default: the records themselves; `projected`, with the methods in `first` run on that many samples a
    task)."""
    def process_time(rows: list[dict], fresh: bool = False) -> float:
        prefill, per_method = spent(rows, fresh)
        return prefill + sum(per_method.values())

    spans = sorted((run["start"], run["end"]) for run in runs if run.get("end"))
    elapsed, cur = 0.0, None
    for s, e in spans:
        if cur is None or s > cur[1]:
            elapsed += (cur[1] - cur[0]) if cur else 0.0
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    elapsed += (cur[1] - cur[0]) if cur else 0.0
    n_samples = len({(r["model"], r["length"], r["task"], r["sample"]) for r in records})
    lines = [f"- {label}: {n_samples} samples, {_hours(process_time(records))} of process time (prefills, "
             f"compression and answers); elapsed wall clock of the runs: {_hours(elapsed)} "
             f"({len(spans)} runs, processes side by side counted once)."]
    headline = [r for r in timing or records if r["task"] in usable.get((r["model"], r["length"]), ())]
    todo = {task: n for task, n in samples.items() if task[2] in usable.get(task[:2], ())}
    if not headline or not todo:
        return lines
    verdicts, every, fewest, missing = [], None, None, []
    for what, keeps in {"every method": lambda r: True, **parts}.items():
        expected = {(r["setting"], r["method"]) for r in records if keeps(r)}
        if not expected:
            continue
        price = projected([r for r in headline if keeps(r)], todo, expected, not_runnable, first)
        wall = (price[0] + sum(price[1].values())) / 2
        verdict = "met" if wall <= WALL_GOAL_H * 3600 else "not met"
        verdict = verdict if not price[3] or verdict == "not met" else "not priced in full"
        verdicts.append(f"{what}, {_hours(wall)} ({verdict})")
        fewest = price[2] if fewest is None else min(fewest, price[2])
        every, missing = every or price, missing or price[3]
    subsets = "".join(f", {m} on the first {n} a task" for m, n in (first or {}).items())
    lines.append(f"  - The headline tasks run from scratch ({sum(todo.values())} samples{subsets}) on two 1-thread "
                 f"processes, priced per sample from {timing_label or 'its own records'} (each price a mean over at "
                 f"least {fewest} samples; each sample prefilled once, kvpress once per setting; process time / 2), "
                 f"against the goal of <= {WALL_GOAL_H:g} h: " + "; ".join(verdicts) + ".")
    if timing:
        cell = lambda r: (r["model"], r["length"], r["task"], r["sample"], r["setting"], r["method"], r["keep_ratio"])  # noqa: E731
        outputs = {cell(r): r["output"] for r in records}
        both = [r for r in timing if cell(r) in outputs]
        lines.append(f"  - The timing run answers as the suite did: {sum(outputs[cell(r)] == r['output'] for r in both)} "
                     f"of its {len(both)} answers that the suite also has are the same text.")
    if missing:
        lines.append("  - Not priced (run on no sample of a task, so left out of the figures above): "
                     + "; ".join(missing) + ".")
    lines.append(f"  - Where that goes (every method; process time, twice the wall time on two processes): prefills "
                 f"{_hours(every[0])}, then per method (compression or press, and its share of the answers): " + ", ".join(
                     f"{m} {_hours(t)}" for m, t in sorted(every[1].items(), key=lambda kv: -kv[1])) + ".")
    return lines


def prefill_lines(press_records: list[dict], timing: list[dict] | None, quiet: list[dict] | None = None) -> list[str]:
    """Median seconds of one prefill per model x length: kvpress's SDPA prefill (its full-cache rows, one per
    sample and setting) and eager one (observed-attention's), as its records timed them, against kvmem's (the
    timing run's, one per sample for both settings). `quiet`: rows of `results/race/prefill-timing.py`, the
    same prefills timed one process at a time, per arm (library and attention path), which separates the
    libraries from the conditions the records were timed in."""
    sdpa, eager, mine = defaultdict(list), defaultdict(dict), defaultdict(dict)
    for r in press_records:
        if r["method"] == "full":
            sdpa[r["model"], r["length"]].append(r["prefill_s"])
        elif r["method"] in EAGER_PRESSES:  # one eager prefill serves the press's ratios
            eager[r["model"], r["length"]][r["task"], r["sample"], r["setting"]] = r["prefill_s"]
    for r in timing or []:
        mine[r["model"], r["length"]][r["task"], r["sample"]] = r["prefill_s"]
    cells = []
    for key in sorted(sdpa):
        cell = f"{key[0]} @ {key[1]}: kvpress {statistics.median(sdpa[key]):.0f} s"
        if eager[key]:
            cell += f" (eager {statistics.median(eager[key].values()):.0f} s)"
        if mine[key]:
            ours = statistics.median(mine[key].values())
            cell += f", kvmem {ours:.0f} s ({statistics.median(sdpa[key]) / ours:.1f}x)"
        cells.append(cell)
    if not cells:
        return []
    lines = ["  - Why the race costs more than the suite: kvpress compresses inside the prefill, so it prefills each "
             "setting apart (the aware context holds the question), and observed-attention needs an eager prefill; "
             "its prefill is also slower (transformers 5.2; on Gemma-3 its sliding-window layers attend over the whole "
             "context under a mask, kvmem's over their window only). Median seconds a prefill, kvpress as its records "
             "timed it (over many sessions), kvmem from its timing run: " + "; ".join(cells) + "."]
    arms = defaultdict(list)  # (model, length, library, arm) -> seconds
    for r in quiet or []:
        arms[r["model"], r["length"], r["library"], r["arm"]].append(r["seconds"])
    quiet_cells = []
    for model, length in sorted({k[:2] for k in arms}):
        medians = {k[2:]: statistics.median(v) for k, v in arms.items() if k[:2] == (model, length)}
        press = [v for (library, _), v in medians.items() if library == "kvpress"]
        ours = [v for (_, arm), v in medians.items() if arm.startswith("kvmem")]
        ratio = f" (kvpress / kvmem {press[0] / ours[0]:.2f}x)" if press and ours else ""
        quiet_cells.append(f"{model} @ {length}: " + ", ".join(
            f"{arm} ({library}'s venv) {v:.1f} s" for (library, arm), v in sorted(medians.items())) + ratio)
    if quiet_cells:
        n = len({(r["model"], r["sample"]) for r in quiet})
        lines.append("  - The same prefills timed on a quiet machine, one process at a time, in one sitting "
                     f"(`results/race/prefill-timing.py`, {n} samples, medians): " + "; ".join(quiet_cells) + ". What "
                     "the records' ratio has beyond this came from the conditions they were timed in (what ran beside "
                     "them), not from the libraries.")
    return lines


def _runs_model(spec: str) -> bool:
    """Does the kvmem method of this spec run the model to score (`Method.needs_model`)? Names the report
    does not know (synthetic records) count as no."""
    from kvmem.compress import METHODS  # torch; the report needs it only here
    cls = METHODS.get(spec.split(":", 1)[0])
    return bool(cls and cls.needs_model)


def _summaries(records: list[dict], press_records: list[dict]):
    """Both libraries' scores, the full-cache table, the usable tasks and the summary rows of each."""
    kvmem, press = Scores(records), Scores(press_records)
    full = full_cache(kvmem)
    usable = usable_tasks(full)
    rows = summary_rows(kvmem, usable)
    press_rows = summary_rows(press, {k: v for k, v in usable.items() if any(p[:2] == k for p in press.keys())}, "kvpress")
    return kvmem, press, full, usable, rows, press_rows


def write_report(out: Path, race_dir: Path | None = None, speed_dir: Path | None = None,
                 quant_dir: Path | None = None) -> list[dict]:
    """Rebuild results.json, report.md and the plots in `out` from its records (and the race, speed and quant
    results beside it, when present). Returns the summary rows."""
    out = Path(out)
    race_dir = Path(race_dir) if race_dir else out.parent / "race"
    speed_dir = Path(speed_dir) if speed_dir else out.parent / "speed"
    quant = read_records((Path(quant_dir) if quant_dir else out.parent / "quant") / "records.jsonl")
    records, press_records = read_records(out / "records.jsonl"), read_records(race_dir / "records.jsonl")
    kvmem, press, full, usable, rows, press_rows = _summaries(records, press_records)
    (out / "results.json").write_text(json.dumps(rows + press_rows, indent=1))

    lines = ["# kvmem long-context benchmark", "", __doc__.split("\n\n", 1)[1].split("`results.json`")[0].strip(), "",
             BENCH_COMMANDS_NOTE, "", "## Cost", ""]
    samples = Counter(key[:3] for key in {(r["model"], r["length"], r["task"], r["sample"]) for r in records})
    heavy = sorted({r["method"] for r in records if _runs_model(r["method"])})
    timing = read_records(out.parent / "cost" / "records.jsonl") if (out.parent / "cost" / "records.jsonl").exists() else None
    commits = sorted({r.get("commit", "?") for r in timing or []})
    windowed = {r["model"] for r in records if ":sliding=" in r["method"]}  # models with sliding-window layers
    lines += cost_lines(records, read_records(out / "runs.jsonl"), "kvmem suite", usable, samples,
                        {f"without those that run the model to score ({', '.join(heavy)})": lambda r: r["method"] not in heavy,
                         f"the first seven, the suite the goal was set for ({', '.join(FIRST_METHODS)})":
                             lambda r: r["method"] in FIRST_METHODS},
                        timing, f"a timing run of the current code (`results/cost`, commit {', '.join(commits)})",
                        {(model, m) for model in {task[0] for task in samples} - windowed
                         for m in {r["method"] for r in records if ":sliding=" in r["method"]}})
    if press_records:
        from kvmem_bench.race import COSTLY_FIRST  # how `make race` runs the costly presses

        errors = json.loads((race_dir / "errors.json").read_text()) if (race_dir / "errors.json").exists() else {}
        failing = {(model, name.split(" @ keep ")[0]) for model, presses in errors.get("not_runnable", {}).items()
                   for name in presses}
        lines += cost_lines(press_records, read_records(race_dir / "runs.jsonl"), "kvpress race", usable, samples,
                            {f"the presses matching the first seven ({', '.join(FIRST_PRESSES)})":
                                 lambda r: r["method"] in FIRST_PRESSES,
                             # issue 7 set the goal for the agnostic race; kvpress prefills each setting apart
                             "the agnostic setting alone, every press": lambda r: r["setting"] == "agnostic",
                             "the agnostic setting alone, the presses matching the first seven":
                                 lambda r: r["setting"] == "agnostic" and r["method"] in FIRST_PRESSES},
                            not_runnable=failing, first=COSTLY_FIRST)
        lines += prefill_lines(press_records, timing, read_records(race_dir / "prefill-timing.jsonl"))
    lines += ["", "## Which tasks count", "",
              f"Full-cache score per task (agnostic prompt, 95% CI, n samples); ⚠ = below {FULL_CACHE_MIN}, left out "
              "of every average. A task stopped after its first samples showed the model cannot do it has fewer samples.", ""]
    keys = sorted(full)
    tasks = sorted({t for d in full.values() for t in d})
    lines += ["| task | " + " | ".join(f"{m} @ {L}" for m, L in keys) + " |", "|---|" + "---|" * len(keys)]
    for t in tasks:
        cells = []
        for k in keys:
            got = full[k].get(t)
            cells.append("–" if got is None else f"{_fmt(got[0])} n={got[1]}" + (" ⚠" if got[0].estimate < FULL_CACHE_MIN else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    lines += ["", "## Headline", "",
              "Mean score over the usable tasks with its 95% bootstrap CI. **Bold**: the column's best; ▼: significantly "
              f"below the best (paired bootstrap on the same samples, at least {PAIRED_MIN_SAMPLES} of them); no mark: "
              "not distinguishable from the best; "
              "(n=k): run on k samples so far, fewer than the full cache (compared paired, never the best); ▲: such a "
              "method significantly above the best on the samples both ran.", "",
              *headline(rows, usable, full)]
    for model, length in sorted(usable):
        plot = _plot(rows, model, length, out)
        if plot:
            lines += [f"![score vs KV kept, {model} @ {length}]({plot.name})", ""]
    lines += ["## The race against kvpress", "",
              "The same prompts (token ids exported once) through kvpress's presses in its own virtualenv "
              "(`make race`); outputs are scored by the same function. kvmem's best and kvpress's best per keep ratio, "
              f"with the bytes each actually holds after compression; a best is chosen among cells with at least "
              f"{RACE_MIN_SAMPLES} samples (a costly press run on a subset competes once it has them), and the paired "
              "difference is taken on the samples both ran. In the aware setting kvpress compresses the question's "
              "tokens with the context (its own query-aware evaluation); kvmem keeps them and budgets the context.", ""]
    for setting in _race_settings(press_rows):
        lines += [f"### {setting.capitalize()} setting", "", *race_tables(rows, press_rows, kvmem, press, usable, setting=setting)]
    if (race_dir / "errors.json").exists():
        errors = json.loads((race_dir / "errors.json").read_text())
        for model, presses in sorted(errors["not_runnable"].items()):
            failed: dict[tuple[str, str], list[str]] = defaultdict(list)  # (press, error) -> keep ratios
            for name, error in presses.items():
                press_name, keep = name.split(" @ keep ")
                failed[(press_name, error.splitlines()[0][:160])].append(keep)
            for (press_name, error), keeps in sorted(failed.items()):
                lines.append(f"- kvpress fails on {model} with `{press_name}` (keep {', '.join(sorted(keeps, reverse=True))}): {error}")
        lines += [f"- Not run (they download weights or statistics from the hub): {', '.join(errors['skipped_downloads'])}.", ""]
    pareto = _pareto_plot(rows, press_rows, out)
    if pareto:
        lines += [f"![score vs KV bytes held]({pareto.name})", ""]
    lines += ["## Targets of the query-agnostic methods (issue 8)", "", *target_lines(rows, press_rows, kvmem, press, usable, quant)]
    if (speed_dir / "results.json").exists():
        from kvmem_bench.speed import speed_section

        lines += [*speed_section(json.loads((speed_dir / "results.json").read_text())["rows"])]
    lines += ["## Per-task scores (95% CI)", ""]
    for (model, length), ts in sorted(usable.items()):
        for setting in SETTINGS:
            sel = [r for r in rows if (r["model"], r["length"], r["setting"]) == (model, length, setting) and r["task"] != MEAN]
            if not sel:
                continue
            ratios = sorted({r["keep_ratio"] for r in sel}, reverse=True)
            lines += [f"**{model} @ {length}, {setting}**", "", "| task | method | " + " | ".join(f"keep {k:g}" for k in ratios) + " |",
                      "|---|---|" + "---|" * len(ratios)]
            cell = {(r["task"], r["method"], r["keep_ratio"]): r for r in sel}
            for t in ts:
                for m in dict.fromkeys(r["method"] for r in sel if r["method"] != "full"):
                    lines.append(f"| {t} | {m} | " + " | ".join(
                        _cell_text(cell.get((t, "full" if k >= 1.0 else m, k))).strip("*") for k in ratios) + " |")
            lines.append("")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return rows


def update_readme(results: Path = Path("results/longctx"), readme: Path = Path("README.md"),
                  retrieval: Path = Path("results/retrieval/results.json"), race: Path = Path("results/race"),
                  quant: Path = Path("results/quant")) -> None:
    """Rewrite the README's results blocks (between its `<!-- results` and `<!-- retrieval` markers) from
    the long-context records (the report's headline) and the retrieval results.json."""
    results = Path(results)
    kvmem, press, full, usable, rows, press_rows = _summaries(read_records(results / "records.jsonl"),
                                                              read_records(Path(race) / "records.jsonl"))
    race_lines = []
    if press_rows:
        for setting in _race_settings(press_rows):
            race_lines += [f"**The race against kvpress** ({setting}; `make race`): kvmem's best against kvpress's best, "
                           "paired on the samples both ran.", "",
                           *race_tables(rows, press_rows, kvmem, press, usable, fidelity=False, setting=setting)]
        race_lines += ["**Targets of the query-agnostic methods** (issue 8):", "",
                       *target_lines(rows, press_rows, kvmem, press, usable, read_records(Path(quant) / "records.jsonl"))]
    block = "\n".join([
        "<!-- results: regenerated from results/longctx/records.jsonl (the Headline of results/longctx/report.md) -->",
        "Regenerate with `make bench` (it resumes from `results/longctx/records.jsonl`). Mean score over the tasks the",
        f"model answers with its full cache (score >= {FULL_CACHE_MIN}; RULER string match), with 95% bootstrap CIs. **Bold**:",
        f"best in its column; ▼: significantly below it (paired bootstrap, same samples, >= {PAIRED_MIN_SAMPLES}); (n=k): run on fewer samples so far,",
        "never the best; ▲: such a method significantly above the best on the samples both ran. The race against kvpress, speed",
        "and memory, per-task scores and plots: [results/longctx/report.md](results/longctx/report.md).",
        "",
        *headline(rows, usable, full),
        *race_lines,
        "<!-- /results -->",
    ])
    text = readme.read_text()
    new = re.sub(r"<!-- results:.*?<!-- /results -->", lambda m: block, text, flags=re.S)
    if new == text and block not in text:
        raise ValueError(f"{readme} has no results block to update")
    if retrieval.exists():
        from kvmem_bench.retrieval import headline as retrieval_headline

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

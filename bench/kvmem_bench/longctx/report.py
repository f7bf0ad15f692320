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
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvmem_bench.longctx.cost import COSTLY_FIRST, cost_lines, prefill_lines, runs_model  # noqa: E402
from kvmem_bench.longctx.race_tables import pareto_plot, race_settings, race_tables, target_lines  # noqa: E402
from kvmem_bench.longctx.scores import (FULL_CACHE_MIN, MEAN, PAIRED_MIN_SAMPLES, RACE_MIN_SAMPLES, SETTINGS,  # noqa: E402
                                        SHARED, Scores, cell_text, fmt_interval, headline, paired, summaries)
from kvmem_bench.records import read_records  # noqa: E402
from kvmem_bench.stats import Interval  # noqa: E402

FIRST_METHODS = ("full", "h2o", "knorm", "random", "snapkv", "streaming-llm", "tova")  # the suite the goal was set for
FIRST_PRESSES = ("full", *(SHARED[m] for m in FIRST_METHODS if m in SHARED))  # kvpress's side of it
# issue 35's catalog: its scorers, and its allocators (`scorer:budget=NAME`; fastgen sizes its heads itself)
CATALOG_SCORERS = ("keyformer", "vatp", "rcstat", "dapq", "finch", "moment-kv", "kvcrush", "subgen", "attention-matching",
                   "fastgen")
CATALOG_BUDGETS = ("prefixkv", "cokv")
BENCH_COMMANDS_NOTE = "See the Makefile's `bench` and `race` targets for the exact commands."


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


def in_catalog(method: str) -> bool:
    """Whether a method spec is one of issue 35's catalog (a catalog scorer, or any scorer on a catalog allocator)."""
    name, *options = method.split(":")
    return name in CATALOG_SCORERS or any(o in (f"budget={b}" for b in CATALOG_BUDGETS) for o in options)


def catalog_lines(rows: list[dict], kvmem: Scores, usable: dict[tuple, list[str]]) -> list[str]:
    """Issue 35's catalog against kvmem's earlier methods, per model x length x setting x keep ratio: the best of
    each (among methods run on every sample of the cell) and their paired difference, plus every catalog method
    significantly above the earlier best."""
    index = defaultdict(dict)  # (model, length, setting, ratio) -> method -> mean row
    for r in rows:
        if r["task"] == MEAN and r["library"] == "kvmem" and r["method"] != "full" and r["complete"]:
            index[(r["model"], r["length"], r["setting"], r["keep_ratio"])][r["method"]] = r
    lines = []
    for key in sorted(index):
        cell = index[key]
        new = {m: r for m, r in cell.items() if in_catalog(m)}
        old = {m: r for m, r in cell.items() if not in_catalog(m)}
        if not new or not old:
            continue
        best_new = max(new, key=lambda m: new[m]["score"])  # ties: the method listed first
        best_old = max(old, key=lambda m: old[m]["score"])
        model, length, setting, ratio = key
        tasks = set(usable[(model, length)])

        def sample(m):
            return kvmem.samples(model, length, setting, m, ratio, tasks)

        diff = paired(sample(best_new), sample(best_old))
        above = []
        for m in new:
            d = paired(sample(m), sample(best_old))
            if d is not None and d.significant and d.estimate > 0:
                above.append(f"{m} {fmt_interval(d)}")
        n = len(set(sample(best_new)) & set(sample(best_old)))
        verdict = "–" if diff is None else ("catalog above" if diff.significant and diff.estimate > 0 else
                                            "catalog below" if diff.significant else "no difference")
        old_iv, new_iv = (fmt_interval(Interval(r["score"], r["lo"], r["hi"])) for r in (old[best_old], new[best_new]))
        lines.append(f"| {model} @ {length} | {setting} | {ratio:g} | {best_old} {old_iv} | {best_new} {new_iv} | "
                     f"{'–' if diff is None else fmt_interval(diff)} (n={n}) | "
                     f"{verdict} | {'; '.join(above) or '–'} |")
    if not lines:
        return []
    return ["## Issue 35's catalog against kvmem's earlier methods", "",
            f"Catalog: the scorers {', '.join(CATALOG_SCORERS)} (any options), and any scorer with `budget=` "
            f"{' or '.join(CATALOG_BUDGETS)}. Per cell, the best catalog method against the best earlier one (each "
            "chosen on the cell's own samples among methods run on all of them), their paired difference "
            "(catalog − earlier, stratified by task, 95% CI), and every catalog method significantly above the earlier "
            "best. Choosing each side's best on the samples it is judged on favours both sides alike.", "",
            "| model | setting | keep | earlier best | catalog best | catalog − earlier | verdict | catalog methods above the earlier best |",
            "|---|---|---|---|---|---|---|---|", *lines, ""]


def write_report(out: Path, race_dir: Path | None = None, speed_dir: Path | None = None,
                 quant_dir: Path | None = None) -> list[dict]:
    """Rebuild results.json, report.md and the plots in `out` from its records (and the race, speed and quant
    results beside it, when present). Returns the summary rows."""
    out = Path(out)
    race_dir = Path(race_dir) if race_dir else out.parent / "race"
    speed_dir = Path(speed_dir) if speed_dir else out.parent / "speed"
    quant = read_records((Path(quant_dir) if quant_dir else out.parent / "quant") / "records.jsonl")
    records, press_records = read_records(out / "records.jsonl"), read_records(race_dir / "records.jsonl")
    kvmem, press, full, usable, rows, press_rows = summaries(records, press_records)
    (out / "results.json").write_text(json.dumps(rows + press_rows, indent=1))

    lines = ["# kvmem long-context benchmark", "", __doc__.split("\n\n", 1)[1].split("`results.json`")[0].strip(), "",
             BENCH_COMMANDS_NOTE, "", "## Cost", ""]
    samples = Counter(key[:3] for key in {(r["model"], r["length"], r["task"], r["sample"]) for r in records})
    heavy = sorted({r["method"] for r in records if runs_model(r["method"])})
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
            cells.append("–" if got is None else f"{fmt_interval(got[0])} n={got[1]}" + (" ⚠" if got[0].estimate < FULL_CACHE_MIN else ""))
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
    lines += catalog_lines(rows, kvmem, usable)
    lines += ["## The race against kvpress", "",
              "The same prompts (token ids exported once) through kvpress's presses in its own virtualenv "
              "(`make race`); outputs are scored by the same function. kvmem's best and kvpress's best per keep ratio, "
              f"with the bytes each actually holds after compression; a best is chosen among cells with at least "
              f"{RACE_MIN_SAMPLES} samples (a costly press run on a subset competes once it has them), and the paired "
              "difference is taken on the samples both ran. In the aware setting kvpress compresses the question's "
              "tokens with the context (its own query-aware evaluation); kvmem keeps them and budgets the context.", ""]
    for setting in race_settings(press_rows):
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
    pareto = pareto_plot(rows, press_rows, out)
    if pareto:
        lines += [f"![score vs KV bytes held]({pareto.name})", ""]
    lines += ["## Targets of the query-agnostic methods (issue 8)", "", *target_lines(rows, press_rows, kvmem, press, usable, quant)]
    if (speed_dir / "results.json").exists():
        from kvmem_bench.speed.report import speed_section

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
                        cell_text(cell.get((t, "full" if k >= 1.0 else m, k))).strip("*") for k in ratios) + " |")
            lines.append("")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return rows


README_MARKERS = ("<!-- results: regenerated from results/longctx/records.jsonl (the Headline of results/longctx/report.md) -->",
                  "<!-- /results -->")


def readme_block(results: Path = Path("results")) -> str | None:
    """The README's results block: the headline tables, the race against kvpress and issue 8's targets, from
    RESULTS/longctx (and RESULTS/race, RESULTS/quant beside it)."""
    results = Path(results)
    if not (results / "longctx" / "records.jsonl").exists():
        return None
    kvmem, press, full, usable, rows, press_rows = summaries(read_records(results / "longctx" / "records.jsonl"),
                                                             read_records(results / "race" / "records.jsonl"))
    race_lines = []
    if press_rows:
        for setting in race_settings(press_rows):
            race_lines += [f"**The race against kvpress** ({setting}; `make race`): kvmem's best against kvpress's best, "
                           "paired on the samples both ran.", "",
                           *race_tables(rows, press_rows, kvmem, press, usable, fidelity=False, setting=setting)]
        race_lines += ["**Targets of the query-agnostic methods** (issue 8):", "",
                       *target_lines(rows, press_rows, kvmem, press, usable, read_records(results / "quant" / "records.jsonl"))]
    return "\n".join([
        README_MARKERS[0],
        "Regenerate with `make bench` (it resumes from `results/longctx/records.jsonl`). Mean score over the tasks the",
        f"model answers with its full cache (score >= {FULL_CACHE_MIN}; RULER string match), with 95% bootstrap CIs. **Bold**:",
        f"best in its column; ▼: significantly below it (paired bootstrap, same samples, >= {PAIRED_MIN_SAMPLES}); (n=k): run on fewer samples so far,",
        "never the best; ▲: such a method significantly above the best on the samples both ran. The race against kvpress, speed",
        "and memory, per-task scores and plots: [results/longctx/report.md](results/longctx/report.md).",
        "",
        *headline(rows, usable, full),
        *[line.replace("## ", "**", 1) + "**" if line.startswith("## ") else line
          for line in catalog_lines(rows, kvmem, usable)],
        *race_lines,
        README_MARKERS[1],
    ])

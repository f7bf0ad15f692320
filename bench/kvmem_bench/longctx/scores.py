"""The long-context suite's records, read: per-sample scores indexed by cell, the full-cache table, the tasks that
count, summary rows with bootstrap CIs and significance marks, and the headline table.

* A task counts for a model and length when its full-cache score is >= FULL_CACHE_MIN; the rest are
  flagged and left out of every average.
* A headline cell is the mean over the usable tasks (each task weighs the same) with a stratified
  bootstrap CI (`kvmem_bench.stats`).
* "A beats B" is only said from a paired comparison on the same samples whose interval excludes 0. In
  each column the best method is bold; a cell marked ▼ is significantly below it; unmarked cells are
  not distinguishable from the best at this sample size.
"""

from __future__ import annotations

from collections import defaultdict

from kvmem_bench.stats import Interval, bootstrap_mean, paired_difference

FULL_CACHE_MIN = 0.8  # a task whose full-cache score is below this measures nothing about compression
RACE_MIN_SAMPLES = 30  # fewer answers than this (a press run on a subset so far) cannot be a race's best
PAIRED_MIN_SAMPLES = 10  # no paired difference (no ▼/▲, no fidelity verdict) from fewer common samples
MEAN = "mean"  # the task name of rows averaged over the usable tasks
SETTINGS = ("agnostic", "aware")
SHARED = {"random": "random", "streaming-llm": "streaming-llm", "snapkv": "snapkv", "tova": "tova",
          "knorm": "knorm", "h2o": "observed-attention",
          "finch": "finch"}  # kvmem method -> the kvpress press that does the same (finch: FinchPress, see kvpress_presses)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def fmt_interval(iv: Interval, digits: int = 2) -> str:
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


def cell_text(row: dict | None, digits: int = 2) -> str:
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
        lines.append("| full cache (1.0) | " + " | ".join(cell_text(full_row).strip("*") for _ in cols) + " |")
        for m in methods:
            lines.append(f"| {m} | " + " | ".join(cell_text(index.get((model, length, s, m, k))) for s, k in cols) + " |")
        lines.append("")
    return lines


def summaries(records: list[dict], press_records: list[dict]):
    """Both libraries' scores, the full-cache table, the usable tasks and the summary rows of each."""
    kvmem, press = Scores(records), Scores(press_records)
    full = full_cache(kvmem)
    usable = usable_tasks(full)
    rows = summary_rows(kvmem, usable)
    press_rows = summary_rows(press, {k: v for k, v in usable.items() if any(p[:2] == k for p in press.keys())}, "kvpress")
    return kvmem, press, full, usable, rows, press_rows

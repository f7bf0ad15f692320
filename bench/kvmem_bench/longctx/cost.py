"""What the long-context suite and the race cost: process seconds spent (prefills, compression, answers), the wall
clock of the runs, and the suite from scratch priced per sample against WALL_GOAL_H; kvmem's and kvpress's
prefills side by side."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Callable

WALL_GOAL_H = 4.0  # the headline suite, and the race, should each run within this on the 2 cores
# Presses too costly for every sample (KVzip: 4-5 prefills of replay; observed-attention: an eager prefill): `make race`
# runs each on its first N samples a task (longctx.race), and the cost section prices the race the same way.
COSTLY_FIRST = {"kvzip": 10, "observed-attention": 10}


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


def runs_model(spec: str) -> bool:
    """Does the kvmem method of this spec run the model to score (`Method.needs_model`)? Names the report
    does not know (synthetic records) count as no."""
    from kvmem.compress import METHODS  # torch; the report needs it only here
    cls = METHODS.get(spec.split(":", 1)[0])
    return bool(cls and cls.needs_model)

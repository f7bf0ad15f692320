"""The race against kvpress, kvmem's side: export the suite's prompts, run kvpress in its own virtualenv,
score its answers the way kvmem's are scored.

1. `export_tasks`: the long-context suite's samples (same tasks, seed, lengths and chat-template split),
   as token ids, for the tasks the suite swept (screened-out tasks are not raced). Both libraries read
   exactly the same tokens; `eos_ids` carry the model's end-of-turn tokens. Per setting: `agnostic`
   compresses the context and then reads the question; `aware` puts the question (all but its last token)
   into what is compressed, as kvpress's own evaluation does for query-aware runs. kvpress then compresses
   the question's tokens too, where kvmem keeps them and budgets the context alone. `query_window`: how many
   of the context's last tokens a query-conditioned press (FinchPress, raced as kvmem's `finch`) reads as the
   query: the question's (aware), or kvmem finch's stand-in for it, the context's last `Finch.window` (agnostic).
2. `run_kvpress`: `kvpress_runner.py` under `.venv-race` (kvpress pins transformers < 5.3), one process per
   model side by side, each appending to its own raw file (resumable).
3. `score_raw`: kvmem's `score_output` on every raw answer -> `records.jsonl` with `library="kvpress"`, the
   file the report reads beside the suite's records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvmem.errors import KVMemError
from kvmem_bench.longctx.cost import COSTLY_FIRST
from kvmem_bench.longctx.report import write_report
from kvmem_bench.longctx.runner import run_clock
from kvmem_bench.longctx.scores import SETTINGS, Scores, full_cache, usable_tasks
from kvmem_bench.longctx.tasks import make_samples, score_output

RUNNER = Path(__file__).with_name("kvpress_runner.py")
# kvpress presses left out because they download weights or statistics from the Hugging Face hub.
SKIPPED_DOWNLOADS = ("DuoAttentionPress", "QFilterPress", "KVzapPress", "FastKVzipPress", "ExpectedAttentionStatsPress",
                     "LUKVPress", "RestoreKVPress")


def usable_swept_tasks(bench_records: Path) -> dict[tuple[str, int], list[str]]:
    """(model, length) -> tasks the suite ran a sweep on whose full-cache score makes them usable
    (screened-out and flagged tasks tell nothing about compression, so the race skips them)."""
    if not bench_records.exists():
        return {}
    records = [json.loads(line) for line in bench_records.read_text().splitlines()]
    swept: dict[tuple[str, int], set[str]] = {}
    for r in records:
        if r["method"] != "full" and not r["task"].startswith("ppl-"):
            swept.setdefault((r["model"], r["length"]), set()).add(r["task"])
    usable = usable_tasks(full_cache(Scores(records)))
    return {k: sorted(v & set(usable.get(k, ()))) for k, v in swept.items() if v & set(usable.get(k, ()))}


def export_tasks(bench: Path, path: Path, models: list[str] | None = None, lengths: list[int] | None = None,
                 samples: int = 30, seed: int = 0, settings: tuple[str, ...] = ("agnostic",),
                 tasks: list[str] | None = None) -> int:
    """Write the prompts of every usable swept (model, length, task) sample (of `tasks`, when given), once per
    setting, to `path`; returns how many lines."""
    if bad := set(settings) - set(SETTINGS):
        raise KVMemError(f"unknown setting {sorted(bad)[0]!r}; choose from {', '.join(SETTINGS)}")
    from kvmem.compress.finch import Finch
    from kvmem.generate import end_ids
    from kvmem.models import load_model
    from kvmem.prompts import build_prompt

    plan = {k: [t for t in v if not tasks or t in tasks] for k, v in usable_swept_tasks(bench / "records.jsonl").items()
            if (not models or k[0] in models) and (not lengths or k[1] in lengths)}
    plan = {k: v for k, v in plan.items() if v}
    if missing := sorted(set(tasks or ()) - {t for v in plan.values() for t in v}):
        raise KVMemError(f"task {missing[0]!r} is not a usable swept task (full cache >= 0.8) in {bench / 'records.jsonl'} "
                         f"for models {models or 'any'} and lengths {lengths or 'any'}: the race runs only those")
    if not plan:
        raise KVMemError(f"no usable swept task (full cache >= 0.8) in {bench / 'records.jsonl'} for models "
                         f"{models or 'any'} and lengths {lengths or 'any'}: run the suite on them first (`make bench`)")
    window = Finch().window  # kvmem finch's default: its suite records are made with it
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w") as f:
        for model in sorted({m for m, _ in plan}):
            lm = load_model(model)
            for (m, length), tasks in sorted(plan.items()):
                if m != model:
                    continue
                for task in tasks:
                    for i, s in enumerate(make_samples(task, lm.tokenizer, length, samples, seed)):
                        p = build_prompt(lm.tokenizer, s.context, s.question, s.answer_prefix)
                        for setting in settings:
                            ctx, question = ((p.context, p.question) if setting == "agnostic" else
                                             (p.context + p.question[:-1], p.question[-1:]))
                            # kvmem finch's rule (Finch.spans): the last `window` tokens, never into the chat head
                            query = (len(p.context) - max(min(p.head, len(p.context) - 1), len(p.context) - window)
                                     if setting == "agnostic" else len(p.question) - 1)
                            f.write(json.dumps(dict(model=model, model_path=str(lm.folder), length=length, task=task,
                                                    sample=i, setting=setting, context_ids=ctx, question_ids=question,
                                                    query_window=query,
                                                    answers=list(s.answers), max_new_tokens=s.max_new_tokens,
                                                    one_line=s.one_line, eos_ids=sorted(end_ids(lm)))) + "\n")
                            n += 1
    return n


def run_kvpress(tasks: Path, out: Path, venv: Path, threads: int = 1, extra: list[str] | None = None) -> None:
    """One runner process per model in the task file, side by side; each appends to out/raw-MODEL.jsonl."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise KVMemError(f"no kvpress virtualenv at {venv}: run `make race-setup` first")
    models = sorted({json.loads(line)["model"] for line in tasks.read_text().splitlines() if line.strip()})
    procs = []
    with run_clock(out / "runs.jsonl", models=models, threads=threads):
        try:
            for model in models:
                cmd = [str(python), str(RUNNER), "--tasks", str(tasks), "--out", str(out / f"raw-{model}.jsonl"),
                       "--models", model, "--threads", str(threads), *(extra or [])]
                log = open(out / f"runner-{model}.log", "a")
                procs.append((model, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})))
            failed = [m for m, p in procs if p.wait() != 0]
        finally:  # stopped: the runners stop too (each has appended its finished samples)
            for _, p in procs:
                if p.poll() is None:
                    p.terminate()
    if failed:
        raise KVMemError(f"the kvpress runner failed for {', '.join(failed)}: see {out}/runner-*.log")


def score_raw(out: Path) -> int:
    """Score every raw kvpress answer with kvmem's function: rewrites out/records.jsonl, and out/errors.json
    with the presses kvpress could not run on a model (never scored). Returns the number of records."""
    answers = {}
    for path in sorted(out.glob("tasks*.jsonl")):  # every export so far (runs per model write their own)
        for line in path.read_text().splitlines():
            s = json.loads(line)
            answers[(s["model"], s["length"], s["task"], s["sample"])] = s["answers"]
    rows, errors = [], {}
    for raw in sorted(out.glob("raw-*.jsonl")):
        for line in raw.read_text().splitlines():
            r = json.loads(line)
            if r.get("error"):
                errors.setdefault(r["model"], {})[f"{r['method']} @ keep {r['keep_ratio']:g}"] = r["error"]
                continue
            key = (r["model"], r["length"], r["task"], r["sample"])
            if "answers" in r:  # runners since 2026-12-02 record the expected answers with each answer
                if answers.setdefault(key, r["answers"]) != r["answers"]:
                    raise KVMemError(f"{raw.name} and {out}/tasks*.jsonl disagree on the answers of {key}: the "
                                     "export or the race records are stale; export again and rerun that sample")
            if key not in answers:
                raise KVMemError(f"{raw.name} has an answer for {key} but no exported prompt in {out}/tasks*.jsonl: "
                                 "export it again (`kvmem race` with that model and length)")
            r["score"] = score_output(answers[key], r["output"])
            rows.append(r)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "errors.json").write_text(json.dumps(dict(not_runnable=errors, skipped_downloads=SKIPPED_DOWNLOADS), indent=1))
    return len(rows)


def race(bench: Path = Path("results/longctx"), out: Path = Path("results/race"), venv: Path = Path(".venv-race"),
         models: list[str] | None = None, lengths: list[int] | None = None, samples: int = 30, threads: int = 1,
         check: int = 0, presses: list[str] | None = None, first: int | None = None,
         settings: tuple[str, ...] = ("agnostic",), only_tasks: list[str] | None = None,
         ratios: list[float] | None = None) -> Path:
    """Export, run kvpress (or, with `check`, compare its pipeline with the harness on `check` samples a
    model), score, and rebuild the suite's report with the race in it. `presses` limits the presses run and
    `first` the samples per task they run on; without `first`, the presses in COSTLY_FIRST run on their own first
    samples a task. `only_tasks` limits the tasks and `ratios` the keep ratios (default: the runner's). Records
    accumulate."""
    if ratios is not None and not all(0 < r < 1 for r in ratios):
        raise KVMemError(f"keep ratios must be in (0, 1); got {','.join(map(str, ratios))}")
    out.mkdir(parents=True, exist_ok=True)
    # one file per (models, lengths, tasks) asked for: runs side by side never overwrite each other's prompts,
    # which score_raw reads the answers from
    tasks = out / (f"tasks-{'-'.join(sorted(models)) if models else 'all'}"
                   f"-{'-'.join(map(str, sorted(lengths))) if lengths else 'all'}"
                   f"{''.join('-' + t for t in sorted(only_tasks or ()))}.jsonl")
    export_tasks(bench, tasks, models, lengths, samples, settings=settings, tasks=only_tasks)
    ratio_option = ["--ratios", ",".join(map(str, ratios))] if ratios else []
    if check:
        for model in sorted({json.loads(line)["model"] for line in tasks.read_text().splitlines()}):
            subprocess.run([str(venv / "bin" / "python"), str(RUNNER), "--tasks", str(tasks), "--models", model,
                            "--check", str(check), "--check-out", str(out / f"harness_check-{model}.json"),
                            "--threads", str(threads), *(["--presses", ",".join(presses)] if presses else []),
                            *ratio_option], check=True, stdout=sys.stderr)
        return out
    runs = [(presses, first)]
    if presses and first is None:  # the costly presses on their own subsets
        cheap = [p for p in presses if p not in COSTLY_FIRST]
        runs = ([(cheap, None)] if cheap else []) + [([p], COSTLY_FIRST[p]) for p in presses if p in COSTLY_FIRST]
    for names, n in runs:
        to_run = tasks
        if n is not None:  # sample i does not depend on the count, so the first N are a fixed subset
            to_run = out / f"subset-first{n}-{tasks.name}"
            to_run.write_text("".join(line + "\n" for line in tasks.read_text().splitlines() if json.loads(line)["sample"] < n))
        run_kvpress(to_run, out, venv, threads, (["--presses", ",".join(names)] if names else []) + ratio_option or None)
    score_raw(out)
    write_report(bench, out)
    return out

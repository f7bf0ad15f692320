"""The long-context benchmark: every method x keep ratio on one prefill per sample.

For each sample the context is prefilled once into a `KVCache` that records queries and accumulated
attention; every (method, keep ratio) then works on a copy of that cache. Two settings, reported apart:

* `agnostic`: the context is compressed before the question is seen (what a stored, reusable cache
  can do); the question and answer prefix are then fed on top of the compressed cache.
* `aware`: the question (all but its last token) is read first, the context part is compressed with
  the question's queries observed and the question's tokens kept, then the last token is fed.

Either way every generated token is computed from the compressed cache. Perplexity tasks (`ppl-*`)
compress the context and measure the mean NLL of a continuation (agnostic only).

Per-sample records are appended to `records.jsonl` as they finish, so an interrupted run resumes
where it stopped; `results.json` (one row per model x length x task x setting x method x ratio) and
the report are rebuilt from all records at the end.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from kvmem import __version__
from kvmem.compress import METHODS, compress, get_method
from kvmem.errors import KVMemError
from kvmem.eval.tasks import TASKS, make_samples, perplexity_text, score
from kvmem.generate import decode, feed, nll
from kvmem.models import LoadedModel, load_model
from kvmem.cache import KVCache

PPL_TASKS = ("ppl-recall", "ppl-next")
ALL_TASKS = tuple(TASKS) + PPL_TASKS
DEFAULT_RATIOS = (1.0, 0.5, 0.25, 0.1)
PPL_CONTINUATION = 128
SETTINGS = ("agnostic", "aware")
FULL_CACHE_MIN = 0.5  # tasks the full cache scores below this are screened out (they measure nothing)


@dataclass
class EvalConfig:
    models: list[str]
    lengths: list[int]
    tasks: list[str] = field(default_factory=lambda: list(ALL_TASKS))
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    samples: int = 3
    seed: int = 0
    out: Path = Path("results/longctx")

    def validate(self) -> None:
        for t in self.tasks:
            if t not in ALL_TASKS:
                raise KVMemError(f"unknown task {t!r}; choose from {', '.join(ALL_TASKS)}")
        for m in self.methods:
            get_method(m)
        for r in self.ratios:
            if not 0.0 < r <= 1.0:
                raise KVMemError(f"keep ratio must be in (0, 1]; got {r}")
        if self.samples < 1:
            raise KVMemError("--samples must be at least 1")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _configs(methods: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs to run. Keep ratio 1.0 is the full cache for every method (compress is a
    no-op then, see test_keep_all_is_identical), so it is run once as `full` and reported for all."""
    pairs = [("full", 1.0)]
    pairs += [(m, r) for m in methods if m != "full" for r in ratios if r < 1.0]
    return pairs


@dataclass
class Prefilled:
    """One sample's context read once: the caches every configuration copies."""

    ctx: list[int]
    question: list[int]
    sources: dict[str, tuple[KVCache, int]]  # setting -> (cache, its KV bytes)
    prefill_s: float


def prefill_sample(lm: LoadedModel, sample, settings: tuple[str, ...] = SETTINGS) -> Prefilled:
    tok = lm.tokenizer
    ctx = tok(sample.context).input_ids
    q = tok(sample.question + sample.answer_prefix, add_special_tokens=False).input_ids
    base = KVCache(lm.model.config, observe_window=64, track_attention=True)
    t0 = time.perf_counter()
    feed(lm, base, ctx)
    prefill_s = time.perf_counter() - t0
    sources = {"agnostic": (base, base.kv_bytes())}
    if "aware" in settings:
        aware = base.clone()
        feed(lm, aware, q[:-1])  # the question's queries are observed; its last token is fed after compression
        sources["aware"] = (aware, aware.kv_bytes())
    return Prefilled(ctx, q, sources, prefill_s)


def answer_configs(lm: LoadedModel, sample, pre: Prefilled, configs: list[tuple[str, float]]) -> list[dict]:
    """Answer `sample` once per (setting, method, ratio), each on a fresh copy of the prefilled cache."""
    records = []
    for setting, (src, full) in pre.sources.items():
        for method, ratio in configs:
            t0 = time.perf_counter()
            cache = src.clone()
            compress(cache, get_method(method), ratio, protect_from=len(pre.ctx) if setting == "aware" else None)
            kv = cache.kv_bytes()
            cache.drop_observations()
            logits = feed(lm, cache, pre.question if setting == "agnostic" else pre.question[-1:])
            out = lm.tokenizer.decode(decode(lm, cache, logits, sample.max_new_tokens))
            records.append(dict(setting=setting, method=method, keep_ratio=ratio, score=score(sample, out),
                                output=out, kv_bytes=kv, kv_bytes_full=full, wall_s=time.perf_counter() - t0,
                                prefill_s=pre.prefill_s, context_tokens=len(pre.ctx) + len(pre.question)))
            del cache
    return records


def run_sample(lm: LoadedModel, sample, methods: list[str], ratios: list[float],
               settings: tuple[str, ...] = SETTINGS) -> list[dict]:
    """Prefill one sample's context once, then answer with every (setting, method, ratio) on copies."""
    return answer_configs(lm, sample, prefill_sample(lm, sample, settings), _configs(methods, ratios))


def _run_ppl(lm: LoadedModel, ctx: list[int], cont: list[int], methods, ratios) -> list[dict]:
    base = KVCache(lm.model.config, observe_window=64, track_attention=True)
    t0 = time.perf_counter()
    feed(lm, base, ctx[:-1])
    prefill_s = time.perf_counter() - t0
    full = base.kv_bytes()
    records = []
    for method, ratio in _configs(methods, ratios):
        t0 = time.perf_counter()
        cache = base.clone()
        compress(cache, get_method(method), ratio)
        kv = cache.kv_bytes()
        cache.drop_observations()
        loss = nll(lm, cache, ctx[-1:] + cont)
        records.append(dict(setting="agnostic", method=method, keep_ratio=ratio, score=math.exp(loss), output="",
                            kv_bytes=kv, kv_bytes_full=full, wall_s=time.perf_counter() - t0, prefill_s=prefill_s,
                            context_tokens=len(ctx)))
        del cache
    return records


def _run_task(lm: LoadedModel, model_name: str, task: str, L: int, pending: list[int], cfg: EvalConfig,
              records_path: Path) -> dict[int, list[dict]]:
    """Run the pending samples of one task. QA tasks are screened: all samples are prefilled and answered
    with the full cache first; only if the full cache scores >= FULL_CACHE_MIN does the sweep run."""
    if task in PPL_TASKS:
        pairs = perplexity_text(lm.tokenizer, L - PPL_CONTINUATION - 1, PPL_CONTINUATION, cfg.samples, cfg.seed,
                                kind=task.split("-", 1)[1])
        return {i: _run_ppl(lm, *pairs[i], cfg.methods, cfg.ratios) for i in pending}
    samples = make_samples(task, lm.tokenizer, L, cfg.samples, cfg.seed)
    prefilled = {i: prefill_sample(lm, samples[i]) for i in pending}
    recs = {i: answer_configs(lm, samples[i], prefilled[i], [("full", 1.0)]) for i in pending}
    earlier = [r["score"] for r in _records(records_path) if (r["model"], r["length"], r["task"], r["method"],
               r["setting"]) == (model_name, L, task, "full", "agnostic")]
    full_scores = earlier + [r["score"] for rs in recs.values() for r in rs if r["setting"] == "agnostic"]
    if sum(full_scores) / len(full_scores) >= FULL_CACHE_MIN:
        sweep = _configs(cfg.methods, cfg.ratios)[1:]
        for i in pending:
            recs[i] += answer_configs(lm, samples[i], prefilled[i], sweep)
    return recs


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _done_keys(path: Path) -> set[tuple]:
    return {(r["model"], r["length"], r["task"], r["sample"]) for r in _records(path)}


def run(cfg: EvalConfig, progress: bool = True) -> Path:
    """Run what is missing from `cfg.out/records.jsonl`, then rebuild results.json and the report."""
    from kvmem.eval.report import write_report

    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    records_path = cfg.out / "records.jsonl"
    done = _done_keys(records_path)
    for model_name in cfg.models:
        todo = [(L, t, i) for L in cfg.lengths for t in cfg.tasks for i in range(cfg.samples)
                if (model_name, L, t, i) not in done]
        if not todo:
            continue
        lm = load_model(model_name)
        for L in cfg.lengths:
            if L > lm.max_context:
                raise KVMemError(f"context length {L} is longer than {model_name} allows ({lm.max_context})")
        bar = tqdm(total=len(todo), desc=model_name, disable=not progress, unit="sample")
        for L in cfg.lengths:
            for task in cfg.tasks:
                pending = [i for (L2, t, i) in todo if L2 == L and t == task]
                if not pending:
                    continue
                bar.set_postfix_str(f"{task} @ {L}")
                recs = _run_task(lm, model_name, task, L, pending, cfg, records_path)
                with records_path.open("a") as f:
                    for i, rs in recs.items():
                        for r in rs:
                            f.write(json.dumps(dict(model=model_name, length=L, task=task, sample=i, **r)) + "\n")
                bar.update(len(pending))
        bar.close()
    rows = aggregate(records_path, cfg)
    (cfg.out / "results.json").write_text(json.dumps(rows, indent=1))
    write_report(rows, cfg)
    return cfg.out


def aggregate(records_path: Path, cfg: EvalConfig) -> list[dict]:
    """One row per model x length x task x setting x method x keep ratio (means over samples), from every
    record in the folder, so runs of different models and lengths into one folder make one report."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    records = _records(records_path)
    methods = list(dict.fromkeys(r["method"] for r in records))
    for r in records:
        groups[(r["model"], r["length"], r["task"], r["setting"], r["method"], r["keep_ratio"])].append(r)
    rows = []
    commit = git_commit()
    for (model, length, task, setting, method, ratio), rs in sorted(groups.items()):
        for m in ([method] if method != "full" else methods):  # keep ratio 1.0 is the full cache for all
            rows.append(dict(
                model=model, length=length, task=task, setting=setting, method=m, keep_ratio=ratio,
                score=sum(r["score"] for r in rs) / len(rs), n=len(rs),
                kv_bytes=round(sum(r["kv_bytes"] for r in rs) / len(rs)),
                kv_bytes_full=round(sum(r["kv_bytes_full"] for r in rs) / len(rs)),
                fraction_kept=sum(r["kv_bytes"] / r["kv_bytes_full"] for r in rs) / len(rs),
                wall_s=sum(r["wall_s"] for r in rs) / len(rs),
                prefill_s=sum(r["prefill_s"] for r in rs) / len(rs),
                context_tokens=round(sum(r["context_tokens"] for r in rs) / len(rs)),
                kvmem=__version__, commit=commit,
            ))
    return rows

"""The long-context benchmark: every method x keep ratio on one prefill per sample.

Prompts go through the model's chat template (`kvmem.prompts`): the document is the compressible
context, the question (with the end of the user turn, the generation prompt and an answer prefix) comes
after it. For each sample the context is prefilled once into a `KVCache` that records queries and
accumulated attention (H2O's; tracked attention is computed in the same pass, see `KVLayer.observe`, and
only when a method run on the sample needs it);
every (method, keep ratio) then works on a copy of that cache. Two settings, reported apart:

* `agnostic`: the context is compressed before the question is seen (what a stored, reusable cache
  can do); the question is then fed on top of the compressed cache.
* `aware`: the question (all but its last token) is read first, the context part is compressed with
  the question's queries observed and the question's tokens kept, then the last token is fed.

Either way every generated token is computed from the compressed cache. All compressed copies of one
sample and setting are answered together in one batched forward (`kvmem.generate.answer_batch`): on a
CPU decoding is bound by reading the weights, so this is several times cheaper than one by one.
Perplexity tasks (`ppl-*`) compress the context and measure the mean NLL of a continuation (agnostic).

Tasks are screened: a task whose full-cache score is below `SCREEN_STOP` after `SCREEN_SAMPLES` samples
is stopped there, and a task below `FULL_CACHE_MIN` over all its samples is flagged in the report.
Per-sample records are appended to `records.jsonl` as each sample finishes, so an interrupted run
resumes where it stopped; `results.json` and the report are rebuilt from all records at the end.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
from tqdm import tqdm

from kvmem import __version__
from kvmem.compress import METHODS, ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem_bench.longctx.report import write_report
from kvmem_bench.longctx.tasks import TASKS, make_samples, perplexity_text, score
from kvmem.forward import feed
from kvmem.generate import answer_batch, decode, nll
from kvmem.models import LoadedModel, load_model
from kvmem.cache import KVCache
from kvmem.prompts import Prompt, build_prompt
from kvmem_bench.records import git_commit, read_records

PPL_TASKS = ("ppl-recall", "ppl-next")
ALL_TASKS = tuple(TASKS) + PPL_TASKS
DEFAULT_RATIOS = (1.0, 0.5, 0.25, 0.1)
PPL_CONTINUATION = 128
SETTINGS = ("agnostic", "aware")
SCREEN_SAMPLES, SCREEN_STOP = 8, 0.7  # skip a task's sweep when the full cache fails its first samples


@dataclass
class EvalConfig:
    models: list[str]
    lengths: list[int]
    tasks: list[str] = field(default_factory=lambda: list(ALL_TASKS))
    methods: list[str] = field(default_factory=lambda: [m for m in METHODS if not METHODS[m].decode_phase])
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))
    samples: int = 3
    first_sample: int = 0  # run samples first_sample..samples-1: two processes can split one task by samples
    seed: int = 0
    out: Path = Path("results/longctx")
    raw_prompt: bool = False  # no chat template (base models)
    settings: tuple[str, ...] = SETTINGS

    def validate(self) -> None:
        for t in self.tasks:
            if t not in ALL_TASKS:
                raise KVMemError(f"unknown task {t!r}; choose from {', '.join(ALL_TASKS)}")
        self.methods = [get_method(m).spec for m in self.methods]  # canonical spelling in results
        if decoding := [m for m in self.methods if get_method(m).decode_phase]:
            raise KVMemError(f"{', '.join(decoding)} compresses only what is generated, and this suite compresses a "
                             "prompt before a short answer: its scores would be the full cache's. Measure it with "
                             "`kvmem eval --suite longgen`")
        for r in self.ratios:
            if not 0.0 < r <= 1.0:
                raise KVMemError(f"keep ratio must be in (0, 1]; got {r}")
        if self.samples < 1:
            raise KVMemError("--samples must be at least 1")
        if not 0 <= self.first_sample < self.samples:
            raise KVMemError(f"--first-sample must be in [0, --samples) = [0, {self.samples}); got {self.first_sample}")
        if not self.settings or set(self.settings) - set(SETTINGS):
            raise KVMemError(f"--settings: choose among {', '.join(SETTINGS)}; got {', '.join(self.settings) or 'none'}")


def _configs(methods: list[str], ratios: list[float]) -> list[tuple[str, float]]:
    """(method, ratio) pairs to run. Keep ratio 1.0 is the full cache for every method (compress is a
    no-op then, see test_keep_all_is_identical), so it is run once as `full` and reported for all."""
    pairs = [("full", 1.0)]
    pairs += [(m, r) for m in methods if m != "full" for r in ratios if r < 1.0]
    return pairs


@dataclass
class Prefilled:
    """One sample's context read once: the caches every configuration copies."""

    prompt: Prompt
    sources: dict[str, tuple[KVCache, int]]  # setting -> (cache, its KV bytes)
    prefill_s: float


def prefill_sample(lm: LoadedModel, sample, settings: tuple[str, ...] = SETTINGS, raw_prompt: bool = False,
                   track: bool = True, window: int = 64) -> Prefilled:
    """The sample's context prefilled once (attention tracked if `track`: h2o needs it, and it costs), keeping the
    last `window` queries (every scorer reads only its own last ones, so a longer window changes no other score)."""
    prompt = build_prompt(lm.tokenizer, sample.context, sample.question, sample.answer_prefix, raw=raw_prompt)
    base = KVCache(lm.model.config, observe_window=max(64, window), track_attention=track)
    t0 = time.perf_counter()
    feed(lm, base, prompt.context)
    prefill_s = time.perf_counter() - t0
    sources = {"agnostic": (base, base.kv_bytes())}
    if "aware" in settings:
        aware = base.clone()
        feed(lm, aware, prompt.question[:-1])  # the question's queries are observed; its last token comes after compression
        sources["aware"] = (aware, aware.kv_bytes())
    return Prefilled(prompt, sources, prefill_s)


def answer_configs(lm: LoadedModel, sample, pre: Prefilled, configs: list[tuple[str, float]]) -> list[dict]:
    """Answer `sample` once per (setting, method, ratio), each from its own compressed copy of the prefilled
    cache. The copies of one setting are answered in one batch (the full cache, being the longest, alone)."""
    records = []
    for setting, (src, full) in pre.sources.items():
        rows = []
        context = ModelContext(lm, pre.prompt.context, pre.prompt.head,  # kvzip reconstructs once per setting
                               question=pre.prompt.question[:-1] if setting == "aware" else [])
        for method, ratio in configs:
            cache = src.clone()
            t0 = time.perf_counter()
            compress(cache, get_method(method), ratio, protect_from=len(pre.prompt.context) if setting == "aware" else None,
                     context=context)
            compress_s = time.perf_counter() - t0  # kvzip's reconstruction is in its first ratio's time (memoized)
            cache.drop_observations()
            rows.append((method, ratio, cache, cache.kv_bytes(), compress_s))
        question = pre.prompt.question if setting == "agnostic" else pre.prompt.question[-1:]
        records += _answer_offloaded(lm, sample, pre, setting, [r for r in rows if _offloaded(r[2])], question, full)
        rows = [r for r in rows if not _offloaded(r[2])]
        for group in ([r for r in rows if r[1] >= 1.0], [r for r in rows if r[1] < 1.0]):
            if not group:
                continue
            t0 = time.perf_counter()
            outs = answer_batch(lm, [r[2] for r in group], question, sample.max_new_tokens,
                                stop_at_newline=sample.one_line, answers=sample.answers)
            answer_s = time.perf_counter() - t0
            for (method, ratio, _, kv, compress_s), tokens in zip(group, outs):
                out = lm.tokenizer.decode(tokens)
                records.append(dict(setting=setting, method=method, keep_ratio=ratio, score=score(sample, out),
                                    output=out, kv_bytes=kv, kv_bytes_full=full, compress_s=compress_s,
                                    answer_s=answer_s, batch=len(group), prefill_s=pre.prefill_s,
                                    context_tokens=len(pre.prompt.context), prompt_tokens=len(pre.prompt.ids)))
        del rows
    return records


def _offloaded(cache: KVCache) -> bool:
    return any(getattr(layer.rows, "retrieves", False) for layer in cache.layers)


def _answer_offloaded(lm: LoadedModel, sample, pre: Prefilled, setting: str, rows: list, question: list[int],
                      full: int) -> list[dict]:
    """Answers from offloaded caches (compress/offload/), one by one: each retrieves its own rows as it attends, so
    they are not batched. `kv_bytes` is the resident bytes at their peak (after offloading, plus the retrieved rows'
    largest buffer), `offloaded_bytes` what the slower tier holds."""
    records = []
    for method, ratio, cache, kv, compress_s in rows:
        t0 = time.perf_counter()
        logits = feed(lm, cache, question)
        tokens = decode(lm, cache, logits, sample.max_new_tokens, stop_at_newline=sample.one_line, answers=sample.answers)
        out = lm.tokenizer.decode(tokens)
        records.append(dict(setting=setting, method=method, keep_ratio=ratio, score=score(sample, out), output=out,
                            kv_bytes=kv + cache.retrieved_peak_bytes(), kv_bytes_full=full,
                            offloaded_bytes=cache.offloaded_bytes(), compress_s=compress_s,
                            answer_s=time.perf_counter() - t0, batch=1, prefill_s=pre.prefill_s,
                            context_tokens=len(pre.prompt.context), prompt_tokens=len(pre.prompt.ids)))
    return records


def run_sample(lm: LoadedModel, sample, methods: list[str], ratios: list[float],
               settings: tuple[str, ...] = SETTINGS, raw_prompt: bool = False) -> list[dict]:
    """Prefill one sample's context once, then answer with every (setting, method, ratio) on copies."""
    track = any(get_method(m).needs_attention for m in methods)
    window = max(get_method(m).observe_window for m in methods)
    return answer_configs(lm, sample, prefill_sample(lm, sample, settings, raw_prompt, track, window),
                          _configs(methods, ratios))


def _run_ppl(lm: LoadedModel, ctx: list[int], cont: list[int], methods, ratios) -> list[dict]:
    base = KVCache(lm.model.config, observe_window=64, track_attention=True)
    t0 = time.perf_counter()
    feed(lm, base, ctx[:-1])
    prefill_s = time.perf_counter() - t0
    full = base.kv_bytes()
    records = []
    context = ModelContext(lm, ctx[:-1])
    for method, ratio in _configs(methods, ratios)[0 if "full" in methods else 1:]:
        t0 = time.perf_counter()
        cache = base.clone()
        compress(cache, get_method(method), ratio, context=context)
        kv = cache.kv_bytes()
        cache.drop_observations()
        loss = nll(lm, cache, ctx[-1:] + cont)
        kv += cache.retrieved_peak_bytes()  # an offloaded cache's working set, at its peak (0 for eviction)
        records.append(dict(setting="agnostic", method=method, keep_ratio=ratio, score=math.exp(loss), output="",
                            kv_bytes=kv, kv_bytes_full=full, answer_s=time.perf_counter() - t0, prefill_s=prefill_s,
                            context_tokens=len(ctx)))
        del cache
    return records


class Pending(NamedTuple):
    """What one sample still lacks: the methods missing from some setting, the settings to prefill for them, and
    the (setting, method) pairs already recorded (not written again)."""

    methods: list[str]
    settings: tuple[str, ...]
    done: set[tuple[str, str]]


def _run_task(lm: LoadedModel, model_name: str, task: str, L: int, pending: dict[int, Pending], cfg: EvalConfig,
              records_path: Path) -> None:
    """Run the pending samples of one task, appending each sample's records as it finishes; a method added to the
    suite later runs on the samples already done, and a setting added later on the methods that lack it.

    Screening: the first SCREEN_SAMPLES samples are answered with the full cache first, their prefilled
    caches held. If the full cache averages below SCREEN_STOP on them, the model cannot do this task:
    only those full-cache answers are written (the report flags the task) and the sweep is skipped."""
    stamp = dict(kvmem=__version__, commit=git_commit(), threads=torch.get_num_threads())

    def write(i: int, recs: list[dict]) -> None:
        recs = [r for r in recs if (r["setting"], r["method"]) not in pending[i].done]
        lines = "".join(json.dumps(dict(model=model_name, length=L, task=task, sample=i, **r, **stamp)) + "\n" for r in recs)
        fd = os.open(records_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:  # one write of the whole sample: processes running side by side never interleave their lines
            os.write(fd, lines.encode())
        finally:
            os.close(fd)

    if task in PPL_TASKS:
        pairs = perplexity_text(lm.tokenizer, L - PPL_CONTINUATION - 1, PPL_CONTINUATION, cfg.samples, cfg.seed,
                                kind=task.split("-", 1)[1])
        for i, todo in pending.items():
            write(i, _run_ppl(lm, *pairs[i], todo.methods, cfg.ratios))
        return
    samples = make_samples(task, lm.tokenizer, L, cfg.samples, cfg.seed)
    full = [r["score"] for r in read_records(records_path) if (r["model"], r["length"], r["task"], r["method"],
            r["setting"]) == (model_name, L, task, "full", "agnostic")]
    if len(full) >= SCREEN_SAMPLES and sum(full[:SCREEN_SAMPLES]) / SCREEN_SAMPLES < SCREEN_STOP:
        return  # screened out in an earlier run
    held: list[tuple[int, Prefilled, list[dict]]] = []  # screening samples, waiting for the decision
    for n, (i, (missing, settings, have)) in enumerate(pending.items()):
        screened = ("agnostic", "full") in have  # its agnostic full-cache answer is what screening reads
        if not screened and "agnostic" not in settings:
            raise KVMemError(f"{task} @ {L}, sample {i}: its full-cache agnostic answer is not recorded yet, and "
                             "screening reads it (whether the model can do the task): run the agnostic setting first")
        sweep = _configs([m for m in missing if m != "full"], cfg.ratios)[1:]
        # tracked only when a method needs it (h2o): a method added later without it gets the cheaper prefill
        pre = prefill_sample(lm, samples[i], settings, raw_prompt=cfg.raw_prompt,
                             track=any(get_method(m).needs_attention for m in missing),
                             window=max(get_method(m).observe_window for m in missing))
        if screened:  # in an earlier run: only the methods (or settings) added since
            write(i, answer_configs(lm, samples[i], pre, [("full", 1.0)] * ("full" in missing) + sweep))
            continue
        first = answer_configs(lm, samples[i], pre, [("full", 1.0)])
        if len(full) >= SCREEN_SAMPLES:
            write(i, first + answer_configs(lm, samples[i], pre, sweep))
            continue
        held.append((i, pre, first, sweep))
        full.append(next(r["score"] for r in first if r["setting"] == "agnostic"))
        if len(full) == SCREEN_SAMPLES or n == len(pending) - 1:
            if len(full) == SCREEN_SAMPLES and sum(full) / len(full) < SCREEN_STOP:
                for j, _, recs, _ in held:
                    write(j, recs)
                return
            for j, held_pre, recs, held_sweep in held:
                write(j, recs + answer_configs(lm, samples[j], held_pre, held_sweep))
            held = []


def _done_methods(path: Path) -> dict[tuple, set[tuple[str, str]]]:
    """(model, length, task, sample) -> the (setting, method) pairs recorded for it."""
    done: dict[tuple, set[tuple[str, str]]] = {}
    for r in read_records(path):
        done.setdefault((r["model"], r["length"], r["task"], r["sample"]), set()).add((r.get("setting", "agnostic"),
                                                                                      r["method"]))
    return done


def _pending(have: set[tuple[str, str]], methods: list[str], settings: tuple[str, ...]) -> Pending | None:
    """What a sample lacks of `methods` in `settings`: None when nothing."""
    needed = tuple(s for s in settings if any((s, m) not in have for m in methods))
    if not needed:
        return None
    return Pending([m for m in methods if any((s, m) not in have for s in needed)], needed, have)


class _SigtermExit:
    """SIGTERM raises SystemExit (so `finally` blocks run, as on Ctrl-C) until `restore`."""

    def __init__(self):
        self.stopped, self.previous = False, None
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self.previous = signal.signal(signal.SIGTERM, self._exit)

    def _exit(self, signum, frame) -> None:
        self.stopped = True
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


@contextmanager
def run_clock(path: Path, **fields) -> Iterator[None]:
    """Append when the block ran to `path` (runs.jsonl: the report's wall clock), also when it is stopped by
    SIGTERM or Ctrl-C, so that a benchmark stopped to free the machine still counts its time."""
    started, stop = time.time(), _SigtermExit()
    try:
        yield
    finally:
        with path.open("a") as f:
            run = dict(start=started, end=time.time(), threads=torch.get_num_threads(), commit=git_commit())
            f.write(json.dumps({**run, **fields, "stopped": stop.stopped}) + "\n")
        stop.restore()


def run(cfg: EvalConfig, progress: bool = True) -> Path:
    """Run what is missing from `cfg.out/records.jsonl`, then rebuild results.json and the report."""
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    records_path = cfg.out / "records.jsonl"
    done = _done_methods(records_path)
    methods = list(dict.fromkeys(["full", *cfg.methods]))
    with run_clock(cfg.out / "runs.jsonl", models=cfg.models, lengths=cfg.lengths):
        for model_name in cfg.models:
            todo = {(L, t, i): p for L in cfg.lengths for t in cfg.tasks
                    for i in range(cfg.first_sample, cfg.samples)
                    if (p := _pending(done.get((model_name, L, t, i), set()), methods,
                                      ("agnostic",) if t in PPL_TASKS else cfg.settings))}
            if not todo:
                continue
            lm = load_model(model_name)
            for L in cfg.lengths:
                if L > lm.max_context:
                    raise KVMemError(f"context length {L} is longer than {model_name} allows ({lm.max_context})")
            bar = tqdm(total=len(todo), desc=model_name, disable=not progress, unit="sample")
            for L in cfg.lengths:
                for task in cfg.tasks:
                    pending = {i: p for (L2, t, i), p in todo.items() if L2 == L and t == task}
                    if not pending:
                        continue
                    bar.set_postfix_str(f"{task} @ {L}")
                    _run_task(lm, model_name, task, L, pending, cfg, records_path)
                    bar.update(len(pending))
            bar.close()
    write_report(cfg.out)
    return cfg.out

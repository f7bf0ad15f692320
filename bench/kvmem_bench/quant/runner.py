"""The quantization benchmark's run (see the package doc): its three parts and the run that resumes them."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.compress import ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem.quant import SCHEMES, get_scheme
from kvmem_bench.perplexity import ppl_texts, token_nlls
from kvmem_bench.quant import FULL, HF_BASELINES, PARTS
from kvmem_bench.quant.caches import from_rows, held_bytes, hf_supports, kv_elements, new_cache, prepared_scheme, runnable
from kvmem_bench.records import append_record, read_records


def default_schemes() -> list[str]:
    return [s for s in SCHEMES] + list(HF_BASELINES)


@dataclass
class QuantConfig:
    models: list[str]
    schemes: list[str] = field(default_factory=default_schemes)
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    length: int = 2048  # tokens of each perplexity text
    texts: int = 2
    chunk: int = 32
    decode_length: int = 2048
    decode_steps: int = 24
    decode_warmup: int = 3
    task_length: int = 2048
    task_samples: int = 10  # per usable task
    task_methods: list[str] = field(default_factory=lambda: ["kvzip"])
    task_ratios: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.1])
    task_schemes: list[str] | None = None  # schemes crossed with eviction (default: all but HF's and 8-bit)
    # the long-context suite's settings the tasks run in; aware: the question is read before compression and kept
    task_settings: tuple[str, ...] = ("agnostic",)
    bench: Path = Path("results/longctx")  # the suite whose usable tasks are used
    out: Path = Path("results/quant")

    def validate(self) -> None:
        for s in self.schemes + (self.task_schemes or []):
            if s.startswith("hf-") and s not in HF_BASELINES:
                raise KVMemError(f"unknown HF baseline {s!r}; choose from {', '.join(HF_BASELINES)}")
            if s not in HF_BASELINES and s != FULL:
                get_scheme(s)  # a named error for an unknown scheme or option
        if bad := set(self.parts) - set(PARTS):
            raise KVMemError(f"unknown part {sorted(bad)[0]!r} of the quant suite; choose from {', '.join(PARTS)}")
        if self.chunk < 1 or self.length < 2 * self.chunk or self.texts < 1:
            raise KVMemError(f"perplexity needs texts >= 1 of at least two chunks; got {self.texts} x {self.length} "
                             f"tokens in chunks of {self.chunk}")
        if not self.task_settings or set(self.task_settings) - {"agnostic", "aware"}:
            raise KVMemError(f"task settings must be agnostic and/or aware; got {','.join(self.task_settings) or 'none'}")
        for r in self.task_ratios:
            if not 0.0 < r <= 1.0:
                raise KVMemError(f"keep ratio must be in (0, 1]; got {r}")
        self.task_methods = [get_method(m).spec for m in self.task_methods]


# -- perplexity ----------------------------------------------------------------------------------------
def run_ppl(lm, model: str, cfg: QuantConfig, done: set, prepared: dict, log=print) -> None:
    texts = ppl_texts(lm.tokenizer, cfg.length, cfg.texts)
    for name in [FULL, *runnable(lm, cfg.schemes, log)]:
        for t, ids in enumerate(texts):
            key = ("ppl", model, name, t, cfg.length, cfg.chunk)
            if key in done:
                continue
            cache = new_cache(lm, name, prepared)
            t0 = time.perf_counter()
            nlls = token_nlls(lm, cache, ids, cfg.chunk)
            rec = dict(part="ppl", model=model, scheme=name, text=t, length=cfg.length, chunk=cfg.chunk, nll=nlls,
                       seconds=time.perf_counter() - t0, kv_bytes=held_bytes(cache), elements=kv_elements(lm, cache))
            append_record(cfg.out / "records.jsonl", rec)
            log(f"ppl {model} {name} text {t}: {math.exp(sum(nlls) / len(nlls)):.3f}, {rec['kv_bytes'] / 2**20:.1f} MiB")


# -- decode speed --------------------------------------------------------------------------------------
@torch.no_grad()
def run_decode(lm, model: str, cfg: QuantConfig, done: set, prepared: dict, log=print) -> None:
    from transformers import DynamicCache

    from kvmem_bench.speed.runner import context_ids
    from kvmem.forward import feed

    schemes = runnable(lm, cfg.schemes, log)
    names = ["dynamic", FULL, *schemes]
    if all(("decode", model, n, cfg.decode_length) in done for n in names):
        return
    n = min(cfg.decode_length, lm.max_context - cfg.decode_steps - cfg.decode_warmup - 1)
    ids = context_ids(lm.tokenizer, n)
    base = KVCache(lm.model.config)
    feed(lm, base, ids[:n])
    caches = {"dynamic": DynamicCache(config=lm.model.config), FULL: base}
    for i, layer in enumerate(base.layers):  # the same rows in a DynamicCache (untouched by the timing of ours)
        caches["dynamic"].layers[i].update(*(torch.stack(t)[None].clone() for t in (layer.head_keys, layer.head_values)))
    for name in schemes:
        caches[name] = from_rows(lm, base, name, prepared)
    ms: dict[str, list[float]] = {k: [] for k in caches}
    kinds = list(caches)
    token = ids[n:n + 1]
    for step in range(cfg.decode_warmup + cfg.decode_steps):
        for j in range(len(kinds)):
            kind = kinds[(step + j) % len(kinds)]
            t0 = time.perf_counter()
            feed(lm, caches[kind], token)
            if step >= cfg.decode_warmup:
                ms[kind].append(1000 * (time.perf_counter() - t0))
    for kind in kinds:
        append_record(cfg.out / "records.jsonl", dict(part="decode", model=model, scheme=kind, length=cfg.decode_length,
                                                context_tokens=n, ms=ms[kind], kv_bytes=held_bytes(caches[kind]),
                                                threads=torch.get_num_threads()))
    log(f"decode {model} @ {n}: " + ", ".join(f"{k} {sorted(v)[len(v) // 2]:.0f} ms" for k, v in ms.items()))


# -- tasks ---------------------------------------------------------------------------------------------
def task_cells(cfg: QuantConfig) -> list[tuple[str, float, str]]:
    """(eviction method, keep ratio, scheme) cells: every scheme alone, and the eviction methods at each ratio
    with nothing and with each crossed scheme."""
    crossed = cfg.task_schemes if cfg.task_schemes is not None else [
        s for s in cfg.schemes if s not in HF_BASELINES and not s.startswith("kivi-8")]
    # HF's KIVI-like axes group along batch x heads x tokens and need that divisible by the group: a prompt of
    # arbitrary length fails in its prefill (ValueError from quanto), so they are measured on perplexity only.
    alone = [s for s in cfg.schemes if "axis_key" not in HF_BASELINES.get(s, {})]
    cells = [("full", 1.0, FULL)] + [("full", 1.0, s) for s in alone]
    cells += [(m, r, s) for m in cfg.task_methods for r in cfg.task_ratios if r < 1.0 for s in [FULL, *crossed]]
    return cells


def cell_label(method: str, ratio: float, scheme: str) -> str:
    if method == "full":
        return scheme
    return f"{method}@{ratio}" + ("" if scheme == FULL else f" + {scheme}")


def _mixed(scheme) -> bool:
    """Schemes that take the eviction's decision themselves (MiKV: evicted rows kept at low precision)."""
    return bool(getattr(scheme, "demotes", False))


@torch.no_grad()
def answer_hf(lm, cache, question: list[int], sample) -> list[int]:
    from kvmem.forward import feed
    from kvmem.generate import decode

    return decode(lm, cache, feed(lm, cache, question), sample.max_new_tokens, sample.one_line, sample.answers)


def run_tasks(lm, model: str, cfg: QuantConfig, done: set, prepared: dict, log=print) -> None:
    from kvmem_bench.longctx.runner import prefill_sample
    from kvmem_bench.longctx.race import usable_swept_tasks
    from kvmem_bench.longctx.tasks import make_samples

    tasks = usable_swept_tasks(cfg.bench / "records.jsonl").get((model, cfg.task_length), [])
    if not tasks:
        log(f"tasks {model} @ {cfg.task_length}: no usable task in {cfg.bench} (run the long-context suite first)")
        return
    cells = [c for c in task_cells(cfg) if c[2] not in HF_BASELINES or hf_supports(lm)]
    track = any(get_method(m).needs_attention for m, _, _ in cells)
    for task in tasks:
        samples = make_samples(task, lm.tokenizer, cfg.task_length, cfg.task_samples)
        for i, sample in enumerate(samples):
            todo = {setting: [c for c in cells if ("tasks", model, cfg.task_length, task, i, cell_label(*c), setting)
                              not in done] for setting in cfg.task_settings}
            todo = {setting: cs for setting, cs in todo.items() if cs}
            if not todo:
                continue
            t0 = time.perf_counter()
            pre = prefill_sample(lm, sample, tuple(todo), track=track)
            for setting, cs in todo.items():
                _answer_cells(lm, model, cfg, task, i, sample, pre, setting, cs, prepared)
            log(f"tasks {model} {task} #{i}: {sum(map(len, todo.values()))} cells in {time.perf_counter() - t0:.0f} s")


def _answer_cells(lm, model: str, cfg: QuantConfig, task: str, i: int, sample, pre, setting: str, cells: list,
                  prepared: dict) -> None:
    """One sample's cells in one setting, each from its own copy of the prefilled cache, as the long-context suite
    answers (aware: the question's tokens before its last are held and protected, its last is fed to answer)."""
    from kvmem_bench.longctx.tasks import score
    from kvmem.generate import answer_batch

    src, full_bytes = pre.sources[setting]
    aware = setting == "aware"
    context = ModelContext(lm, pre.prompt.context, pre.prompt.head, question=pre.prompt.question[:-1] if aware else [])
    question = pre.prompt.question[-1:] if aware else pre.prompt.question
    built, hf = [], []
    for method, ratio, name in cells:
        if name in HF_BASELINES:
            hf.append(((method, ratio, name), from_rows(lm, src, name, prepared)))
            continue
        cache = src.clone()
        scheme = None if name == FULL else prepared_scheme(lm, name, prepared)
        if scheme is not None and _mixed(scheme):
            cache.quantize(scheme)
        if ratio < 1.0:
            compress(cache, get_method(method), ratio, protect_from=len(pre.prompt.context) if aware else None,
                     context=context)
        if scheme is not None and not _mixed(scheme):
            cache.quantize(scheme)
        cache.drop_observations()
        built.append(((method, ratio, name), cache))
    outs = [(c, toks) for batch in (built[:1], built[1:]) if batch
            for c, toks in zip([b[0] for b in batch], answer_batch(
                lm, [b[1] for b in batch], question, sample.max_new_tokens,
                stop_at_newline=sample.one_line, answers=sample.answers))]
    outs += [(c, answer_hf(lm, cache, question, sample)) for c, cache in hf]
    bytes_of = {c: held_bytes(cache) for c, cache in built + hf}
    for c, toks in outs:
        text = lm.tokenizer.decode(toks)
        append_record(cfg.out / "records.jsonl", dict(
            part="tasks", model=model, length=cfg.task_length, task=task, sample=i, setting=setting,
            cell=cell_label(*c), method=c[0], keep_ratio=c[1], scheme=c[2], score=score(sample, text), output=text,
            kv_bytes=bytes_of[c], kv_bytes_full=full_bytes))


# -- the run -------------------------------------------------------------------------------------------
def _done(records: list[dict]) -> set:
    keys = set()
    for r in records:
        if r["part"] == "ppl":
            keys.add(("ppl", r["model"], r["scheme"], r["text"], r["length"], r["chunk"]))
        elif r["part"] == "decode":
            keys.add(("decode", r["model"], r["scheme"], r["length"]))
        else:
            keys.add(("tasks", r["model"], r["length"], r["task"], r["sample"], r["cell"], r.get("setting", "agnostic")))
    return keys


def run_quant(cfg: QuantConfig, log=print) -> Path:
    from kvmem_bench.quant.report import write_report
    from kvmem.models import load_model

    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    done = _done(read_records(cfg.out / "records.jsonl"))
    for model in cfg.models:
        lm = load_model(model)
        prepared: dict = {}
        if "ppl" in cfg.parts:
            run_ppl(lm, model, cfg, done, prepared, log)
        if "decode" in cfg.parts:
            run_decode(lm, model, cfg, done, prepared, log)
        if "tasks" in cfg.parts:
            run_tasks(lm, model, cfg, done, prepared, log)
    write_report(cfg.out)
    return cfg.out

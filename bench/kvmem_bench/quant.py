"""The quantization benchmark (`kvmem eval --suite quant`): every scheme of `kvmem.quant` beside transformers'
own `QuantizedCache` (quanto and fp8 backends) in one run.

Three parts, each resumable from OUT/records.jsonl (a record is written as soon as it is measured):

* `ppl`: perplexity of long held-out text (the last tokens of the shipped abstracts; calibration reads the
  first ones), teacher-forced in chunks of `chunk` tokens so every chunk reads what the earlier ones left
  quantized. Per-token NLLs are kept, so Delta-ppl against the full-precision cache comes with a paired block
  bootstrap CI (blocks = chunks). Bytes held are measured after the whole text (`KVCache.kv_bytes()`, or the
  tensors of HF's quantized layers), with bits per stored element.
* `decode`: ms per decoded token on a `decode_length` context, every cache fed the same token in rotating
  order (drift hits all alike); ratios per step to kvmem's full-precision cache and to HF's QuantizedCache
  at the same bits (geometric mean with a bootstrap CI). Goal: no slower than HF's at the same bits.
* `tasks`: the long-context suite's usable tasks (same samples and scoring as `results/longctx`, agnostic
  setting), each sample prefilled once at full precision; every (eviction method, keep ratio, scheme) cell
  compresses a copy, then quantizes what is kept (MiKV instead demotes what the method would evict), and is
  answered from it. HF's caches are built from the same prefilled rows (the first `update` of its layers
  quantizes them, as its own prefill would). This gives the task table and the eviction x quantization
  frontier (score against bytes held; points at >= 10x fewer bytes marked).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.compress import ModelContext, compress, get_method
from kvmem.errors import KVMemError
from kvmem_bench.stats import bootstrap_mean
from kvmem.quant import SCHEMES, get_scheme

# transformers' QuantizedCache settings beside ours: its defaults, the KIVI-like axes the issue measured, fp8.
HF_BASELINES = {
    "hf-quanto-4": dict(backend="quanto", nbits=4),
    "hf-quanto-4-kivi": dict(backend="quanto", nbits=4, axis_key=-1, axis_value=0, q_group_size=32),
    "hf-quanto-2": dict(backend="quanto", nbits=2),
    "hf-quanto-2-kivi": dict(backend="quanto", nbits=2, axis_key=-1, axis_value=0, q_group_size=32),
    "hf-fp8": dict(backend="fp8"),
}
FULL = "full"  # kvmem's KVCache at the model's dtype
PARTS = ("ppl", "decode", "tasks")
TEN_X = 10.0  # the frontier's mark: at least this many times fewer bytes than the full cache


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
        for r in self.task_ratios:
            if not 0.0 < r <= 1.0:
                raise KVMemError(f"keep ratio must be in (0, 1]; got {r}")
        self.task_methods = [get_method(m).spec for m in self.task_methods]


# -- caches --------------------------------------------------------------------------------------------
def hf_cache(lm, name: str):
    """transformers' QuantizedCache in the setting `name` (HF_BASELINES)."""
    from transformers import QuantizedCache

    try:
        return QuantizedCache(config=lm.model.config, **HF_BASELINES[name])
    except ImportError as e:  # quanto is a dependency; say which one is missing
        raise KVMemError(f"{name} needs optimum-quanto (pip install optimum-quanto): {e}") from None


def hf_supports(lm) -> bool:
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma-3's): it has no such layer."""
    types = getattr(lm.model.config.get_text_config(), "layer_types", None) or []
    return all(t == "full_attention" for t in types)


def runnable(lm, schemes: list[str], log=print) -> list[str]:
    """The schemes that can run on `lm` (HF's baselines only where its QuantizedCache takes the model)."""
    skipped = [s for s in schemes if s in HF_BASELINES and not hf_supports(lm)]
    if skipped:
        log(f"{lm.name}: skipping {', '.join(skipped)}: transformers' QuantizedCache supports only models whose layers "
            "are all full attention")
    return [s for s in schemes if s not in skipped]


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (quanto's packed QTensors)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def hf_kv_bytes(cache) -> int:
    """Bytes an HF cache holds: its quantized states (if any) plus the full-precision keys and values."""
    total = 0
    for layer in cache.layers:
        for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
            for t in (q if isinstance(q, tuple) else (q,)):
                if isinstance(t, torch.Tensor):
                    total += _tensor_bytes(t)
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)
                     if isinstance(t, torch.Tensor) and t.dim() == 4)
    return total


def kv_elements(lm, cache) -> int:
    """Key and value elements the cache stands for (rows x channels), whatever it holds them as."""
    if isinstance(cache, KVCache):
        return sum(k.numel() + v.numel() for layer in cache.layers for k, v, _ in layer.rows.heads())
    text = lm.model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return sum(layer.cumulative_length * text.num_key_value_heads * 2 * head_dim for layer in cache.layers)


def held_bytes(cache) -> int:
    return cache.kv_bytes() if isinstance(cache, KVCache) else hf_kv_bytes(cache)


def new_cache(lm, name: str, prepared: dict):
    """An empty cache for `name`: kvmem's full-precision cache, a kvmem scheme (prepared once per model) or HF's."""
    if name == FULL:
        return KVCache(lm.model.config)
    if name in HF_BASELINES:
        return hf_cache(lm, name)
    return KVCache(lm.model.config, quant=prepared_scheme(lm, name, prepared))


def prepared_scheme(lm, name: str, prepared: dict):
    if name not in prepared:
        prepared[name] = get_scheme(name, lm)
    return prepared[name]


def from_rows(lm, src: KVCache, name: str, prepared: dict):
    """A cache `name` holding `src`'s rows (every head the same positions, i.e. not evicted): kvmem's quantized
    rows, or an HF cache whose first update quantizes them all, as its prefill would."""
    if name in HF_BASELINES:
        cache = hf_cache(lm, name)
        for i, layer in enumerate(src.layers):
            k, v = (torch.stack(t)[None] for t in (layer.head_keys, layer.head_values))
            cache.layers[i].update(k, v)
        return cache
    return src.clone().quantize(prepared_scheme(lm, name, prepared))


# -- records -------------------------------------------------------------------------------------------
def _append(path: Path, rec: dict) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())
    finally:
        os.close(fd)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# -- perplexity ----------------------------------------------------------------------------------------
def ppl_texts(tokenizer, length: int, n: int) -> list[list[int]]:
    """`n` texts of `length` tokens from the end of the shipped abstracts (calibration reads the beginning)."""
    from kvmem.calibration import load_abstracts

    ids = tokenizer("\n\n".join(load_abstracts()), add_special_tokens=False).input_ids
    if len(ids) < n * length + 8192:
        raise KVMemError(f"the shipped text has {len(ids)} tokens: too few for {n} held-out texts of {length}")
    return [ids[len(ids) - (j + 1) * length:len(ids) - j * length] for j in range(n)]


@torch.no_grad()
def token_nlls(lm, cache, ids: list[int], chunk: int) -> list[float]:
    """NLL of ids[1:], fed in chunks of `chunk` tokens on top of `cache` (each chunk reads the cache as left)."""
    x = torch.tensor([ids])
    out: list[float] = []
    for start in range(0, len(ids) - 1, chunk):
        part = x[:, start:start + chunk]
        logits = lm.model(input_ids=part, cache=cache, use_cache=True).logits[0].float()
        targets = x[0, start + 1:start + 1 + part.shape[1]]
        out += torch.nn.functional.cross_entropy(logits[:len(targets)], targets, reduction="none").tolist()
    return out


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
            _append(cfg.out / "records.jsonl", rec)
            log(f"ppl {model} {name} text {t}: {math.exp(sum(nlls) / len(nlls)):.3f}, {rec['kv_bytes'] / 2**20:.1f} MiB")


# -- decode speed --------------------------------------------------------------------------------------
@torch.no_grad()
def run_decode(lm, model: str, cfg: QuantConfig, done: set, prepared: dict, log=print) -> None:
    from transformers import DynamicCache

    from kvmem_bench.speed import context_ids
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
        _append(cfg.out / "records.jsonl", dict(part="decode", model=model, scheme=kind, length=cfg.decode_length,
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
    from kvmem_bench.longctx import prefill_sample
    from kvmem_bench.race import usable_swept_tasks
    from kvmem_bench.tasks import make_samples, score
    from kvmem.generate import answer_batch

    tasks = usable_swept_tasks(cfg.bench / "records.jsonl").get((model, cfg.task_length), [])
    if not tasks:
        log(f"tasks {model} @ {cfg.task_length}: no usable task in {cfg.bench} (run the long-context suite first)")
        return
    cells = [c for c in task_cells(cfg) if c[2] not in HF_BASELINES or hf_supports(lm)]
    track = any(get_method(m).needs_attention for m, _, _ in cells)
    for task in tasks:
        samples = make_samples(task, lm.tokenizer, cfg.task_length, cfg.task_samples)
        for i, sample in enumerate(samples):
            todo = [c for c in cells if ("tasks", model, cfg.task_length, task, i, cell_label(*c)) not in done]
            if not todo:
                continue
            t0 = time.perf_counter()
            pre = prefill_sample(lm, sample, ("agnostic",), track=track)
            src, full_bytes = pre.sources["agnostic"]
            context = ModelContext(lm, pre.prompt.context, pre.prompt.head)
            built, hf = [], []
            for method, ratio, name in todo:
                if name in HF_BASELINES:
                    hf.append(((method, ratio, name), from_rows(lm, src, name, prepared)))
                    continue
                cache = src.clone()
                scheme = None if name == FULL else prepared_scheme(lm, name, prepared)
                if scheme is not None and _mixed(scheme):
                    cache.quantize(scheme)
                if ratio < 1.0:
                    compress(cache, get_method(method), ratio, context=context)
                if scheme is not None and not _mixed(scheme):
                    cache.quantize(scheme)
                cache.drop_observations()
                built.append(((method, ratio, name), cache))
            outs = [(c, toks) for batch in (built[:1], built[1:]) if batch
                    for c, toks in zip([b[0] for b in batch], answer_batch(
                        lm, [b[1] for b in batch], pre.prompt.question, sample.max_new_tokens,
                        stop_at_newline=sample.one_line, answers=sample.answers))]
            outs += [(c, answer_hf(lm, cache, pre.prompt.question, sample)) for c, cache in hf]
            bytes_of = {c: held_bytes(cache) for c, cache in built + hf}
            for c, toks in outs:
                text = lm.tokenizer.decode(toks)
                _append(cfg.out / "records.jsonl", dict(
                    part="tasks", model=model, length=cfg.task_length, task=task, sample=i, cell=cell_label(*c),
                    method=c[0], keep_ratio=c[1], scheme=c[2], score=score(sample, text), output=text,
                    kv_bytes=bytes_of[c], kv_bytes_full=full_bytes))
            log(f"tasks {model} {task} #{i}: {len(todo)} cells in {time.perf_counter() - t0:.0f} s")


# -- the run -------------------------------------------------------------------------------------------
def _done(records: list[dict]) -> set:
    keys = set()
    for r in records:
        if r["part"] == "ppl":
            keys.add(("ppl", r["model"], r["scheme"], r["text"], r["length"], r["chunk"]))
        elif r["part"] == "decode":
            keys.add(("decode", r["model"], r["scheme"], r["length"]))
        else:
            keys.add(("tasks", r["model"], r["length"], r["task"], r["sample"], r["cell"]))
    return keys


def run_quant(cfg: QuantConfig, log=print) -> Path:
    from kvmem_bench.quant_report import write_report
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


def delta_ppl(pairs: list[tuple[list[float], list[float]]], block: int) -> tuple[float, float, float]:
    """Delta perplexity in percent of a against base over texts [(nll_a, nll_base), ...], with a 95% paired
    block-bootstrap CI (blocks of `block` consecutive tokens of one text, so correlated neighbours are
    resampled together)."""
    diffs = []
    for a, base in pairs:
        n = min(len(a), len(base))
        diffs += [sum(a[i:min(i + block, n)]) / len(a[i:min(i + block, n)])
                  - sum(base[i:min(i + block, n)]) / len(base[i:min(i + block, n)]) for i in range(0, n, block)]
    est, lo, hi = bootstrap_mean(diffs)
    return tuple(100 * (math.exp(x) - 1) for x in (est, lo, hi))

"""The long-output benchmark's run (see the package doc): the copy task and streaming perplexity, resumable."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.compress import Compressor, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import end_ids
from kvmem.prompts import build_prompt
from kvmem_bench.longctx.tasks import perplexity_text
from kvmem_bench.longgen import FULL, PARTS
from kvmem_bench.longgen.copy import copy_sample, copy_score
from kvmem_bench.records import append_record, git_commit, read_records


@dataclass
class LongGenConfig:
    model: str
    methods: list[str] = field(default_factory=lambda: ["h2o", "tova"])
    ratios: list[float] = field(default_factory=lambda: [1.0])  # of the prompt, kept when it is read
    every: int = 1  # decode steps between re-compressions (H2O and TOVA evict at every step)
    extra_rows: int = 64  # rows a head may hold beyond what it kept of the prompt (Compressor's extra_rows)
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    samples: int = 30  # copy prompts
    texts: int = 10  # perplexity texts
    context: int = 1024  # tokens of a perplexity text's context
    continuation: int = 512  # held-out tokens fed one at a time
    out: Path = Path("results/longgen")

    def validate(self) -> None:
        if bad := set(self.parts) - set(PARTS):
            raise KVMemError(f"unknown part {sorted(bad)[0]!r} of the longgen suite; choose from {', '.join(PARTS)}")
        for r in self.ratios:
            if not 0.0 < r <= 1.0 or (r == 1.0 and not self.extra_rows):
                raise KVMemError(f"keep ratio must be in (0, 1], and below 1 without extra_rows (the full cache runs "
                                 f"anyway); got {r}")
        if self.every < 1:
            raise KVMemError(f"every must be >= 1 decode step; got {self.every}")
        for spec in self.methods:  # a named error for methods that cannot run in the cache
            Compressor(get_method(spec), 0.5, self.every, self.extra_rows)
        self.methods = [get_method(m).spec for m in self.methods]


def _cache(lm, spec: str, ratio: float, every: int, extra_rows: int) -> KVCache:
    method = get_method(spec)
    compressor = None if spec == FULL else Compressor(method, ratio, every, extra_rows)
    return KVCache(lm.model.config, observe_window=max(64, method.observe_window),
                   track_attention=method.needs_attention, compressor=compressor)


@torch.no_grad()
def generate_tokens(lm, cache: KVCache, ids: list[int], max_new: int) -> tuple[list[int], float]:
    """Greedy decoding until an end token or `max_new` tokens; returns them and the mean bytes held per step."""
    stop = end_ids(lm)
    logits = feed(lm, cache, ids)
    out: list[int] = []
    held = 0
    while len(out) < max_new and (token := int(logits.argmax())) not in stop:
        out.append(token)
        logits = feed(lm, cache, [token])
        held += cache.kv_bytes()
    return out, held / max(len(out), 1)


@torch.no_grad()
def streaming_nlls(lm, cache: KVCache, context: list[int], continuation: list[int]) -> tuple[list[float], float]:
    """NLL of each continuation token, fed one at a time after the context; and the mean bytes held per step."""
    logits = feed(lm, cache, context)
    nlls, held = [], 0
    for token in continuation:
        nlls.append(float(torch.nn.functional.cross_entropy(logits.float()[None], torch.tensor([token]))))
        logits = feed(lm, cache, [token])
        held += cache.kv_bytes()
    return nlls, held / len(continuation)


def _cells(cfg: LongGenConfig) -> list[tuple[str, float]]:
    return [(FULL, 1.0)] + [(m, r) for m in cfg.methods for r in cfg.ratios]


def run_longgen_suite(lm, cfg: LongGenConfig, log=print) -> None:
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / "records.jsonl"
    done = {(r["part"], r["model"], r["method"], r["keep_ratio"], r["every"], r["extra_rows"], r["sample"])
            for r in read_records(path)}
    base = dict(model=cfg.model, commit=git_commit(), threads=torch.get_num_threads())

    def setting(spec: str) -> dict:  # the full cache compresses nothing: one run serves every setting
        return dict(every=0, extra_rows=0) if spec == FULL else dict(every=cfg.every, extra_rows=cfg.extra_rows)

    def is_done(part: str, spec: str, ratio: float, i: int) -> bool:
        return (part, cfg.model, spec, ratio, *setting(spec).values(), i) in done
    if "copy" in cfg.parts:
        tok = lm.tokenizer
        for i in range(cfg.samples):
            document, instruction, entries = copy_sample(i)
            prompt = build_prompt(tok, document, instruction)
            listed = len(tok(document.split("\n", 1)[1], add_special_tokens=False).input_ids)
            for spec, ratio in _cells(cfg):
                if is_done("copy", spec, ratio, i):
                    continue
                t0 = time.perf_counter()
                out, held = generate_tokens(lm, _cache(lm, spec, ratio, cfg.every, cfg.extra_rows), prompt.ids, listed + 32)
                text = tok.decode(out)
                rec = dict(part="copy", method=spec, keep_ratio=ratio, sample=i, score=copy_score(entries, text),
                           output=text, tokens=out, prompt_tokens=len(prompt.ids), list_tokens=listed,
                           mean_kv_bytes=held, seconds=time.perf_counter() - t0, **base, **setting(spec))
                append_record(path, rec)
                log(f"copy {cfg.model} {spec}@{ratio} #{i}: {rec['score']:.2f}, {len(out)} tokens, "
                    f"{held / 2**20:.1f} MiB")
    if "ppl" in cfg.parts:
        texts = perplexity_text(lm.tokenizer, cfg.context, cfg.continuation, cfg.texts, kind="next")
        for i, (context, continuation) in enumerate(texts):
            for spec, ratio in _cells(cfg):
                if is_done("ppl", spec, ratio, i):
                    continue
                t0 = time.perf_counter()
                nlls, held = streaming_nlls(lm, _cache(lm, spec, ratio, cfg.every, cfg.extra_rows), context, continuation)
                append_record(path, dict(part="ppl", method=spec, keep_ratio=ratio, sample=i, nll=nlls,
                                         context_tokens=len(context), mean_kv_bytes=held,
                                         seconds=time.perf_counter() - t0, **base, **setting(spec)))
                log(f"ppl {cfg.model} {spec}@{ratio} #{i}: mean nll {sum(nlls) / len(nlls):.3f}, {held / 2**20:.1f} MiB")

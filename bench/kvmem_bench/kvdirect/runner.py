"""The KV-Direct benchmark's run (see the package doc): appends one record per (part, length, sample, method), so a
run resumes where it stopped."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmem.cache import KVCache
from kvmem.compress import Compressor, get_method
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.kvdirect import KVDirectCache, parse
from kvmem_bench.kvdirect import EVICTIONS, FULL, PARTS
from kvmem_bench.records import append_record, git_commit, read_records, uncommitted_changes

TEXT = Path(__file__).parents[3] / "src/kvmem/data/abstracts.txt"


@dataclass
class KVDirectConfig:
    model: str
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    samples: int = 3
    new_tokens: int = 32
    window: int = 256
    checkpoints: list[str] = field(default_factory=lambda: ["layer", "tokens"])
    evictions: list[str] = field(default_factory=lambda: list(EVICTIONS))
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    turn: int = 256  # tokens per turn of the growth part
    growth_length: int = 2048  # tokens the growth part's conversation reaches
    # checkpoint=tokens runs the whole checkpointed prefix again at every step (a prefill a step): decoded only up to
    # this length here (2 CPU cores), its bytes and turn times measured by the growth part
    tokens_max_length: int = 1024
    out: Path = Path("results/kvdirect")

    def validate(self) -> None:
        if bad := set(self.parts) - set(PARTS):
            raise KVMemError(f"unknown part {sorted(bad)[0]!r} of the kvdirect suite; choose from {', '.join(PARTS)}")
        for c in self.checkpoints:
            parse(f"kv-direct:checkpoint={c}:window={self.window}")
        if any(n <= self.window for n in self.lengths):
            raise KVMemError(f"every length must exceed the window ({self.window}): KV-Direct holds everything below it")
        for spec in self.evictions:
            Compressor(get_method(spec), 0.5, every=1)

    def methods(self, length: int | None = None) -> list[str]:
        return [FULL] + [f"kv-direct:checkpoint={c}:window={self.window}" for c in self.checkpoints
                         if length is None or c != "tokens" or length <= self.tokens_max_length] + self.evictions


def sample_ids(lm, length: int, sample: int) -> list[int]:
    """`length` tokens of the shipped abstracts from a sample's own offset (raw text, no template)."""
    text = TEXT.read_text()
    start = (sample * 7919 * 8) % max(len(text) - 8 * length, 1)
    ids = lm.tokenizer(text[start:start + 8 * length])["input_ids"][:length]
    if len(ids) < length:
        raise KVMemError(f"the shipped text gives only {len(ids)} tokens from offset {start}; asked {length}")
    return ids


def make_cache(lm, method: str, length: int, window: int):
    if method.startswith("kv-direct"):
        o = parse(method)
        return KVDirectCache(lm, o.window, o.checkpoint)
    m = get_method(method)
    if method == FULL:
        return KVCache(lm.model.config)
    return KVCache(lm.model.config, observe_window=max(64, m.observe_window), track_attention=m.needs_attention,
                   attention_decay=m.attention_decay, compressor=Compressor(m, window / length, every=1))


def held(cache) -> tuple[int, int]:
    """(K/V bytes, checkpoint bytes) held, measured."""
    return cache.kv_bytes(), cache.checkpoint_bytes() if isinstance(cache, KVDirectCache) else 0


@torch.no_grad()
def run_decode(lm, cache, ids: list[int], new_tokens: int) -> dict:
    t = time.perf_counter()
    logits = feed(lm, cache, ids)
    prefill_s = time.perf_counter() - t
    tokens, step_s, kv, ckpt = [], [], [], []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        t = time.perf_counter()
        logits = feed(lm, cache, tokens[-1:])
        step_s.append(time.perf_counter() - t)
        a, b = held(cache)
        kv.append(a)
        ckpt.append(b)
    return {"tokens": tokens, "prefill_s": prefill_s, "step_s": step_s, "kv_bytes": kv, "checkpoint_bytes": ckpt,
            "recompute_s": getattr(cache, "recompute_s", 0.0), "refed_tokens": getattr(cache, "refed_tokens", 0)}


def run_growth(lm, method: str, ids: list[int], turn: int) -> dict:
    cache = make_cache(lm, method, len(ids), 0)
    fed, kv, ckpt, turn_s = [], [], [], []
    for s in range(0, len(ids), turn):
        t = time.perf_counter()
        feed(lm, cache, ids[s:s + turn])
        turn_s.append(time.perf_counter() - t)
        fed.append(min(s + turn, len(ids)))
        a, b = held(cache)
        kv.append(a)
        ckpt.append(b)
    return {"fed": fed, "kv_bytes": kv, "checkpoint_bytes": ckpt, "turn_s": turn_s}


def run_kvdirect_suite(lm, cfg: KVDirectConfig, log=print) -> Path:
    cfg.out.mkdir(parents=True, exist_ok=True)
    path = cfg.out / "records.jsonl"
    records = read_records(path)
    done = {(r["part"], r["model"], r["length"], r.get("sample"), r["method"]) for r in records}
    base = {"model": lm.name, "window": cfg.window, "commit": git_commit(), "dirty": uncommitted_changes(),
            "threads": torch.get_num_threads()}
    text = lm.model.config.get_text_config()
    shape = {"hidden_size": text.hidden_size, "kv_heads": text.num_key_value_heads, "layers": text.num_hidden_layers,
             "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads}
    if "growth" in cfg.parts:
        ids = sample_ids(lm, cfg.growth_length, 0)
        for method in [FULL] + [m for m in cfg.methods() if m.startswith("kv-direct")]:
            key = ("growth", lm.name, cfg.growth_length, None, method)
            if key in done:
                continue
            r = run_growth(lm, method, ids, cfg.turn)
            append_record(path, {**base, **shape, "part": "growth", "length": cfg.growth_length, "method": method,
                                 "turn": cfg.turn, **r})
            log(f"growth {lm.name} {method}: {(r['kv_bytes'][-1] + r['checkpoint_bytes'][-1]) / 2**20:.1f} MiB at "
                f"{cfg.growth_length}")
    if "decode" in cfg.parts:  # sample by sample over the lengths, so a run cut short still covers every length
        for sample in range(cfg.samples):
            for length in cfg.lengths:
                ids = sample_ids(lm, length, sample)
                for method in cfg.methods(length):
                    key = ("decode", lm.name, length, sample, method)
                    if key in done:
                        continue
                    r = run_decode(lm, make_cache(lm, method, length, cfg.window), ids, cfg.new_tokens)
                    append_record(path, {**base, **shape, "part": "decode", "length": length, "sample": sample,
                                         "method": method, "new_tokens": cfg.new_tokens, **r})
                    log(f"decode {lm.name} {length} #{sample} {method}: step {1e3 * sorted(r['step_s'])[len(r['step_s']) // 2]:.0f} ms, "
                        f"held {(r['kv_bytes'][-1] + r['checkpoint_bytes'][-1]) / 2**20:.1f} MiB")
    return path

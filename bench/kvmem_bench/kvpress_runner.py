"""The kvpress side of the benchmark race: NVIDIA kvpress's presses on the same token inputs as kvmem.

This file runs only in `.venv-race` (`make race-setup`): kvpress 0.5.5 pins transformers<5.3 and kvmem
needs 5.24, so it imports nothing from kvmem and is run by path:

    .venv-race/bin/python bench/kvmem_bench/kvpress_runner.py --tasks T.jsonl --out R.jsonl
    .venv-race/bin/python bench/kvmem_bench/kvpress_runner.py --tasks T.jsonl --check 2 --check-out C.json

Input: one sample a line, {model, model_path, length, task, sample, setting, context_ids, question_ids,
answers, max_new_tokens, eos_ids} (setting: agnostic when absent; for aware, the exporter has put the
question, all but its last token, into context_ids). context_ids (chat head + document) is what gets compressed; question_ids follow
at positions continuing after the context, whatever the cache holds, as in kvpress's pipeline.
Output: one line per (sample, method, keep ratio) appended to --out, a sample's lines once all its presses
are done; methods a sample already has there are skipped (resumable; a later run may add other presses).
No scoring here: kvmem scores `output` with its own function. Where kvpress itself fails (it raises), the
line has `error` and no output. Keep ratio k is kvpress's compression_ratio 1 - k; presses keep their
default hyperparameters; RandomPress draws from the global RNG seeded with the sample number.

One sample costs two prefills, not one per press and ratio (kvpress's pipeline would do 33):
1. One SDPA prefill serves every press but observed-attention and KVzip. A kvpress press compresses a
   layer's cache in a forward hook right after that layer's attention, and nothing later in the prefill
   reads that cache (the next layer gets its hidden states from full attention). So our hook calls every
   press's `compress()` with exactly the arguments kvpress's own hook passes, keeps what it returns (and
   the `masked_key_indices` AdaKV sets), and leaves the real cache full. Presses whose score() ignores the
   ratio compute it once per layer for all ratios.
2. One eager prefill serves observed-attention, which needs attention weights: kvpress requires
   attn_implementation="eager" for it, so its answers are decoded in eager too. A run of observed-attention
   alone on samples whose full-cache row is recorded does this prefill only.
3. KVzip scores tokens by replaying the context over the prefilled cache (its own context manager, handed
   the cache of step 1 instead of prefilling again). The scores do not depend on the ratio, so its
   `compress_post` runs once per ratio on the same scores.
4. Answers come from a DynamicCache built from the kept tensors; head-wise presses (AdaKV, KVzip) keep the
   full cache and mask keys through kvpress's attention patch. Answers whose caches have the same shapes
   are decoded as one batch (bit-identical here; CPU decoding reads all weights per step, so it is cheaper).
   The question is one forward, as in kvpress's pipeline, except where transformers would mask that forward
   wrongly (layers of one kind holding different rows: Gemma-3's compressed global layers, PyramidKV;
   `short_layers`); there it is fed one token at a time.
`--check N` runs kvpress's own pipeline (KVPressTextGenerationPipeline.forward) per press and ratio on N
samples and compares the compressed caches, masks and greedy tokens with this harness.

Decoding (kvmem's rule too): greedy; stop at any eos_ids; stop before a token whose text contains "\\n"
once the text so far has a letter or digit; stop after max_new_tokens, or when the next position would
pass the model's maximum; stop as soon as every answer is in the text (case-insensitive, whitespace
normalised), since more tokens cannot change the score.

KV bytes: `kv_bytes` is the bytes of the cache's key and value tensors right after compression (numel x
element size), `kv_bytes_full` the same without a press; head-wise presses only mask keys, so they hold
the full cache. `kv_storage_bytes` is the storage those tensors pin at that moment (a view counts its whole
storage): more than kv_bytes where layers are views into larger tensors (KVzip's last replay pass,
Gemma's sliding layers into the prefill) until the next forward replaces them.
Times: prefill_s is the prefill that served the row (without the presses' work), press_s the press's own
work (KVzip: all its replay passes), answer_s the row's share of its batch's question + decoding time.

kvpress failures seen on transformers 5.2 (recorded as `error`, exactly as the pipeline raises them):
* PyramidKV, whenever its layer budgets differ (keep 0.5 here): transformers sizes the attention mask
  from one layer's cache length, so the question's forward fails on the other layers. Since the question is
  fed one token at a time there (`short_layers`) it runs (every PyramidKV record was made so).
* Gemma-3: ExpectedAttention (and AdaKV over it) call the rotary embedding without the layer type Gemma-3
  needs; KVzipPress refuses Gemma-3.
Gemma-3 (our Gemma3ForCausalLM): kvpress skips sliding-window layers only for Gemma3ForConditionalGeneration.
On Gemma3ForCausalLM it compresses them too: with the pipeline's DynamicCache() each sliding window is then
applied to the compressed cache's indices (kept tokens are in score order), which runs but answers
nonsense; with DynamicCache(config=...) the answer crashes. So we use kvpress the way it supports
Gemma-3: only global layers are compressed (its own check, extended to Gemma3ForCausalLM), in a
DynamicCache(config=model.config) (with a plain DynamicCache() the global layers' mask is sized from a
sliding layer and the answer crashes). Sliding layers keep their last window - 1 tokens, as views into the
prefill's tensors (kv_storage_bytes counts their whole storage, kv_bytes the window).

Not included, because they download weights or statistics from the Hugging Face hub: DuoAttentionPress,
QFilterPress, KVzapPress, FastKVzipPress, ExpectedAttentionStatsPress, LUKVPress, RestoreKVPress.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from the hub
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    pipeline,
)

# Importing kvpress patches transformers' attention functions so that masked_key_indices mask keys.
from kvpress import (  # noqa: E402
    AdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    ObservedAttentionPress,
    PyramidKVPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses import base_press  # noqa: E402
from kvpress.presses.base_press import is_prefilling  # noqa: E402
from kvpress.utils import extract_keys_and_values  # noqa: E402

transformers.utils.logging.disable_progress_bar()
# kvpress skips Gemma-3's sliding-window layers only for Gemma3ForConditionalGeneration (see the docstring):
# its check, `isinstance(model, Gemma3ForConditionalGeneration)`, now also matches our Gemma3ForCausalLM.
base_press.Gemma3ForConditionalGeneration = (Gemma3ForConditionalGeneration, Gemma3ForCausalLM)

PRESSES = {
    "random": RandomPress,
    "streaming-llm": StreamingLLMPress,
    "snapkv": SnapKVPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
    "observed-attention": ObservedAttentionPress,
    "expected-attention": ExpectedAttentionPress,
    "ada-expected-attention": lambda compression_ratio: AdaKVPress(ExpectedAttentionPress(compression_ratio)),
    "keydiff": KeyDiffPress,
    "pyramidkv": PyramidKVPress,
    "kvzip": KVzipPress,
}
# Presses whose score() does not read compression_ratio: one score per layer serves all their ratios.
RATIO_FREE_SCORES = (SnapKVPress, TOVAPress, KnormPress, KeyDiffPress, ObservedAttentionPress, ExpectedAttentionPress)
EAGER = {"observed-attention"}  # needs attention weights: kvpress requires attn_implementation="eager"
RATIOS = (0.5, 0.25, 0.1)


@dataclass(eq=False)
class Job:
    """One (method, keep ratio) on one sample: its press and, once run, its cache and answer."""

    method: str
    keep_ratio: float
    press: object = None  # None: the full cache
    kv: list = field(default_factory=list)  # per layer (keys, values) as kvpress's cache holds them
    masks: list = field(default_factory=list)  # per layer masked_key_indices (head-wise presses) or None
    prefill_s: float = 0.0
    press_s: float = 0.0
    answer_s: float = 0.0
    tokens: list | None = None
    error: str | None = None

    @property
    def eager(self) -> bool:
        return self.method in EAGER


def make_jobs(methods: list[str], ratios: list[float]) -> list[Job]:
    jobs = [Job("full", 1.0)]
    return jobs + [Job(m, k, PRESSES[m](compression_ratio=1 - k)) for m in methods for k in ratios]


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view holds its whole storage)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def normalize(text: str) -> str:
    return " ".join(text.casefold().split())


_NEWLINES: dict[int, set[int]] = {}


def newline_ids(tok) -> set[int]:
    if id(tok) not in _NEWLINES:
        _NEWLINES[id(tok)] = {i for t, i in tok.get_vocab().items() if "\n" in tok.convert_tokens_to_string([t])}
    return _NEWLINES[id(tok)]


@torch.no_grad()
def decode(model, tok, cache, s: dict, batch: int) -> list[list[int]]:
    """Feed the question on top of `cache` (`batch` identical rows) and decode greedily by the shared rule."""
    question = torch.tensor([s["question_ids"]] * batch)
    position = len(s["context_ids"])  # as kvpress: positions continue after the original context
    # one forward for the question, as kvpress's pipeline, unless transformers would mask it wrongly (short_layers)
    pieces = question.split(1, dim=1) if short_layers(model, cache) else (question,)
    for piece in pieces:
        positions = torch.arange(position, position + piece.shape[1]).expand(batch, -1)
        logits = model(input_ids=piece, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits[:, -1]
        position += piece.shape[1]
    ends, newlines, answers = set(s["eos_ids"]), newline_ids(tok), [normalize(a) for a in s["answers"]]
    outs, done = [[] for _ in range(batch)], [False] * batch
    for _ in range(s["max_new_tokens"]):
        next_ids = logits.argmax(-1)
        for b, token in enumerate(next_ids.tolist()):
            if done[b]:
                continue
            if token in ends or (s.get("one_line", True) and token in newlines
                                 and any(c.isalnum() for c in tok.decode(outs[b]))):
                done[b] = True
                continue
            outs[b].append(token)
            text = normalize(tok.decode(outs[b]))
            done[b] = (bool(answers) and all(a in text for a in answers)) or len(outs[b]) == s["max_new_tokens"] \
                or position >= model.config.max_position_embeddings  # the model's context is full
        if all(done):
            break
        step = torch.full((batch, 1), position)
        logits = model(input_ids=next_ids[:, None], past_key_values=cache, position_ids=step).logits[:, -1]
        position += 1
    return outs


def short_layers(model, cache) -> bool:
    """Does a full-attention layer hold other than the cache's sequence length in rows? transformers 5.2 takes a
    forward's query positions from that length and sizes each layer type's mask from one layer, so a multi-token
    forward is then masked wrongly: not causally on Gemma-3, whose compressed global layers sit beside whole
    sliding windows (every question token sees every later one: changing only the question's last token moves
    its first tokens' logits by up to 9.8, `results/race/question-mask-check.py`), and with mismatched sizes
    under PyramidKV's per-layer budgets (it raises). A single token needs no mask, so one at a time is right."""
    sliding = [getattr(layer.self_attn, "is_sliding", False) for layer in model.model.layers]
    seen = cache.get_seq_length()
    return any(not sl and layer.keys.shape[-2] != seen for sl, layer in zip(sliding, cache.layers))


def new_cache(model) -> DynamicCache:
    """The pipeline's DynamicCache(); Gemma-3 needs the model's config (sliding-window layers, see above)."""
    return DynamicCache(config=model.config) if getattr(model.config, "sliding_window", None) else DynamicCache()


def attention_modules(model) -> list:
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in language_model.layers]


def clear_masks(model) -> None:
    # A head-wise press's masked_key_indices would mask every later forward that is not a prefill.
    for module in attention_modules(model):
        module.masked_key_indices = None


def share_scores(job: Job, scores: dict) -> None:
    """Let presses of one class and the same parameters but different ratios compute score() once per layer
    (a copy each: AdaKV changes its scores in place). Each job is still charged the scoring time."""
    scorer = job.press.press if isinstance(job.press, AdaKVPress) else job.press
    if not isinstance(scorer, RATIO_FREE_SCORES):
        return
    key = (type(scorer), *(getattr(scorer, f.name) for f in fields(scorer) if f.name != "compression_ratio"))
    score = scorer.score

    def shared_score(*args):
        if key in scores:
            job.press_s += scores[key][1]
        else:
            start = time.perf_counter()
            scores[key] = score(*args), time.perf_counter() - start
        return scores[key][0].clone()

    scorer.score = shared_score


@torch.no_grad()
def prefill(model, context_ids: torch.Tensor, jobs: list[Job], seed: int) -> tuple[DynamicCache, float]:
    """One prefill in which every job's press compresses every layer it would compress in kvpress (into
    job.kv / job.masks); the real cache stays full. Returns the cache and the prefill's own seconds."""
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    # Each press draws from its own copy of the global RNG seeded with `seed`: the stream it would see
    # alone after torch.manual_seed(seed) (RandomPress's default seed=None uses the global RNG).
    rng = {job: torch.manual_seed(seed).get_state() for job in jobs}
    n_layers, scores, hook_s = len(language_model.layers), {}, [0.0]
    for job in jobs:
        job.kv, job.masks = [None] * n_layers, [None] * n_layers
        job.press.post_init_from_model(model)
        share_scores(job, scores)

    def hook(module, args, kwargs, output):  # what BasePress.forward_hook does, for every job
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output
        scores.clear()  # a new layer
        hook_start = time.perf_counter()
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for job in jobs:
            if job.error:
                continue
            torch.set_rng_state(rng[job])
            start = time.perf_counter()
            try:
                job.kv[module.layer_idx] = job.press.compress(module, hidden_states, keys, values, output[1], kwargs)
            except Exception as e:  # kvpress cannot run this press on this model: record it, don't fake it
                job.error = f"{type(e).__name__}: {e}"
            job.press_s += time.perf_counter() - start
            rng[job] = torch.get_rng_state()
            job.masks[module.layer_idx] = module.masked_key_indices  # set by head-wise presses, else None
            module.masked_key_indices = None
        hook_s[0] += time.perf_counter() - hook_start
        return output

    hooks = []
    for layer in language_model.layers:
        if isinstance(model, base_press.Gemma3ForConditionalGeneration) and layer.self_attn.is_sliding:
            continue  # as kvpress's BasePress.__call__ (see the Gemma-3 note above)
        layer.self_attn.rotary_emb = language_model.rotary_emb  # as BasePress.__call__: some presses need it
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    clear_masks(model)
    cache = new_cache(model)
    start = time.perf_counter()
    try:
        model.model(input_ids=context_ids, past_key_values=cache)  # as the pipeline: no lm head
    finally:
        for h in hooks:
            h.remove()
    seconds = time.perf_counter() - start - hook_s[0]
    full = [(layer.keys, layer.values) for layer in cache.layers]
    for job in jobs:  # layers a press leaves alone (Gemma-3's sliding layers) stay full
        job.kv = [kv if kv is not None else full[i] for i, kv in enumerate(job.kv)]
        job.prefill_s = seconds
    return cache, seconds


@torch.no_grad()
def kvzip(model, context_ids: torch.Tensor, cache: DynamicCache, jobs: list[Job]) -> None:
    """KVzip's own flow, once for all ratios, on the cache `prefill` left full."""
    press = jobs[0].press
    compress_post = press.compress_post

    def compress_post_for_every_ratio(model):  # its scores (press.score_val) do not depend on the ratio
        scores = press.score_val.clone()  # compress_post changes them in place (sink scores)
        for job in jobs:
            press.compression_ratio, press.score_val = 1 - job.keep_ratio, scores.clone()
            compress_post(model)
            job.masks = [module.masked_key_indices for module in attention_modules(model)]

    press.compress_post = compress_post_for_every_ratio
    clear_masks(model)
    start = time.perf_counter()
    try:
        with press(model):
            # KVzip's prefill is a plain forward over the context (it only records the ids and the cache):
            # the one `prefill` already ran, so hand it that instead of prefilling again.
            press._context_ids, press._cache = context_ids, cache
    except Exception as e:  # KVzipPress refuses Gemma-3
        for job in jobs:
            job.error = f"{type(e).__name__}: {e}"
    finally:
        clear_masks(model)
    for job in jobs:
        job.press_s = time.perf_counter() - start
        job.kv = [(layer.keys, layer.values) for layer in cache.layers]  # views into the last replay pass


def batched_masks(masks: list) -> tuple | None:
    """Each batch row's masked_key_indices (batch, head, position) for one layer, or None, as one triple."""
    rows = [(m[0] + b, m[1], m[2]) for b, m in enumerate(masks) if m is not None]
    return tuple(torch.cat(parts) for parts in zip(*rows)) if rows else None


@torch.no_grad()
def answer(model, tok, s: dict, jobs: list[Job]) -> None:
    """Decode every job's answer; jobs whose caches have the same shapes (and attention) share a batch."""
    groups = defaultdict(list)
    for job in jobs:
        if not job.error:
            groups[job.eager, tuple(k.shape for k, _ in job.kv)].append(job)
    for (eager, _), group in groups.items():
        cache = new_cache(model)
        for i in range(len(group[0].kv)):
            cache.update(torch.cat([job.kv[i][0] for job in group]), torch.cat([job.kv[i][1] for job in group]), i)
            if cache.layers[i].is_sliding:  # it has seen the whole context and holds the window
                cache.layers[i].cumulative_length = len(s["context_ids"])
        for i, module in enumerate(attention_modules(model)):
            module.masked_key_indices = batched_masks([job.masks[i] if job.masks else None for job in group])
        model.set_attn_implementation("eager" if eager else "sdpa")
        start = time.perf_counter()
        try:
            outs = decode(model, tok, cache, s, len(group))
        except Exception as e:  # e.g. PyramidKV: see the docstring
            if len(group) == 1:
                group[0].error = f"{type(e).__name__}: {e}"
                continue
            outs = None
        finally:
            model.set_attn_implementation("sdpa")
            clear_masks(model)
        if outs is None:  # find out which job fails by answering each alone
            for job in group:
                answer(model, tok, s, [job])
            continue
        for job, tokens in zip(group, outs):
            job.tokens, job.answer_s = tokens, (time.perf_counter() - start) / len(group)


@contextmanager
def timed(timing: dict, phase: str):
    """Adds (wall seconds, CPU seconds) of the block to timing[phase] (CPU time: the machine is shared)."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    timing[phase] = (time.perf_counter() - wall, time.process_time() - cpu)


def run_sample(model, tok, s: dict, methods: list[str], ratios: list[float],
               full_done: bool = False) -> tuple[list[Job], dict]:
    """Every method and ratio on one sample; returns the jobs and the (wall, CPU) seconds of each phase.
    With `full_done` (the full cache's row is recorded) and only eager presses to run, the SDPA prefill is
    skipped: jobs[0] then holds the eager prefill's full cache (for kv_bytes_full) and no answer."""
    jobs = make_jobs(methods, ratios)
    context_ids = torch.tensor([s["context_ids"]])
    timing = {}
    sdpa = [j for j in jobs if j.press is not None and not j.eager and not isinstance(j.press, KVzipPress)]
    eager = [j for j in jobs if j.eager]
    zips = [j for j in jobs if isinstance(j.press, KVzipPress)]
    if full_done and eager and not sdpa and not zips:
        with timed(timing, "eager"):
            model.set_attn_implementation("eager")
            try:
                cache, _ = prefill(model, context_ids, eager, seed=s["sample"])
            finally:
                model.set_attn_implementation("sdpa")
        jobs[0].kv = [(layer.keys, layer.values) for layer in cache.layers]
        with timed(timing, "answers"):
            answer(model, tok, s, eager)
        return jobs, timing
    with timed(timing, "prefill+presses"):
        cache, jobs[0].prefill_s = prefill(model, context_ids, sdpa, seed=s["sample"])
    timing["of which the prefill alone"] = (jobs[0].prefill_s, None)
    jobs[0].kv = [(layer.keys, layer.values) for layer in cache.layers]
    if zips:
        with timed(timing, "kvzip"):
            kvzip(model, context_ids, cache, zips)
        for job in zips:
            job.prefill_s = jobs[0].prefill_s
    if eager:
        with timed(timing, "eager"):
            model.set_attn_implementation("eager")
            try:
                prefill(model, context_ids, eager, seed=s["sample"])
            finally:
                model.set_attn_implementation("sdpa")
    with timed(timing, "answers"):
        answer(model, tok, s, jobs)
    return jobs, timing


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors themselves (numel x element size): what the cache keeps once transient views
    (Gemma's sliding layers, KVzip's replay) no longer pin their larger storages."""
    return sum(t.numel() * t.element_size() for t in tensors)


def records(tok, s: dict, jobs: list[Job]) -> list[dict]:
    full = [t for kv in jobs[0].kv for t in kv]
    return [{
        "library": "kvpress", "model": s["model"], "length": s["length"], "task": s["task"], "sample": s["sample"],
        "setting": s.get("setting", "agnostic"), "method": job.method, "keep_ratio": job.keep_ratio,
        "answers": s["answers"],  # scored from the record itself: the exported prompts are not kept
        "output": None if job.error or job.tokens is None else tok.decode(job.tokens), "tokens": job.tokens,
        "kv_bytes": None if job.error else tensor_bytes(t for kv in job.kv for t in kv), "kv_bytes_full": tensor_bytes(full),
        "kv_storage_bytes": None if job.error else held_bytes(t for kv in job.kv for t in kv),
        "prefill_s": round(job.prefill_s, 4), "press_s": round(job.press_s, 4), "answer_s": round(job.answer_s, 4),
        "error": job.error,
    } for job in jobs]


def load(path: str, attn: str = "sdpa"):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
    return model, AutoTokenizer.from_pretrained(path)


def same_masks(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def check(samples: list[dict], methods: list[str], ratios: list[float]) -> dict:
    """Harness vs kvpress's own pipeline (KVPressTextGenerationPipeline.forward: a prefill inside
    `with press(model)`, then the question), per press and ratio; same decoding rule on both."""
    rows, loaded = [], {}
    for s in samples:
        if s["model"] not in loaded:
            loaded.clear()
            model, tok = load(s["model_path"])
            eager_model, _ = load(s["model_path"], "eager")  # what a kvpress user loads for observed-attention
            loaded[s["model"]] = model, tok, {
                False: pipeline("kv-press-text-generation", model=model, tokenizer=tok),
                True: pipeline("kv-press-text-generation", model=eager_model, tokenizer=tok)}
        model, tok, pipes = loaded[s["model"]]
        jobs, _ = run_sample(model, tok, s, methods, ratios)
        for job in jobs:
            ref = {}

            def generate_answer(question_ids, cache, context_length, max_new_tokens, pipe=pipes[job.eager]):
                ref["kv"] = [(layer.keys, layer.values) for layer in cache.layers]
                ref["masks"] = [getattr(m, "masked_key_indices", None) for m in attention_modules(pipe.model)]
                ref["tokens"] = decode(pipe.model, tok, cache, s, 1)[0]
                return tok.decode(ref["tokens"])

            pipe = pipes[job.eager]
            pipe.generate_answer = generate_answer
            press = PRESSES[job.method](compression_ratio=1 - job.keep_ratio) if job.press is not None else None
            torch.manual_seed(s["sample"])  # the seed the harness gives every press's RNG
            try:
                pipe.forward({"context_ids": torch.tensor([s["context_ids"]]),
                              "questions_ids": [torch.tensor([s["question_ids"]])]},
                             press=press, max_new_tokens=s["max_new_tokens"], cache=new_cache(pipe.model))
                ref_error = None
            except Exception as e:
                ref_error = f"{type(e).__name__}: {e}"
            clear_masks(pipe.model)
            row = {"model": s["model"], "length": s["length"], "task": s["task"], "sample": s["sample"],
                   "method": job.method, "keep_ratio": job.keep_ratio,
                   "harness_error": job.error, "pipeline_error": ref_error}
            if job.error is None and ref_error is None:
                row["kv_equal"] = len(job.kv) == len(ref["kv"]) and all(
                    a.shape == b.shape and torch.equal(a, b) for x, y in zip(job.kv, ref["kv"]) for a, b in zip(x, y))
                row["masks_equal"] = all(same_masks(a, b) for a, b in zip(job.masks or [None] * len(ref["masks"]),
                                                                           ref["masks"]))
                row["kv_bytes"] = [held_bytes(t for kv in kvs for t in kv) for kvs in (job.kv, ref["kv"])]
                row["masked_keys"] = sum(len(m[0]) for m in job.masks if m is not None)  # not a vacuous check
                row["tokens_equal"] = job.tokens == ref["tokens"]
                row["tokens"] = [tok.decode(job.tokens), tok.decode(ref["tokens"])]
            row["agree"] = (job.error is None) == (ref_error is None) and all(
                row.get(k, True) for k in ("kv_equal", "masks_equal", "tokens_equal")) and (
                "kv_bytes" not in row or row["kv_bytes"][0] == row["kv_bytes"][1])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
    return {"compared": len(rows), "agree": sum(r["agree"] for r in rows),
            "disagree": [r for r in rows if not r["agree"]], "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", required=True, help="JSONL task file (one sample a line)")
    p.add_argument("--out", help="JSONL records file, appended to; methods a sample already has are skipped")
    p.add_argument("--models", help="comma-separated model names to run (default: all in the task file)")
    p.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated, from: {','.join(PRESSES)}")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="keep ratios, each in (0, 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--check", type=int, default=0, help="compare the harness with kvpress's pipeline on N samples")
    p.add_argument("--check-out", help="JSON summary of --check")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    methods = [m for m in a.presses.split(",") if m]
    ratios = [float(r) for r in a.ratios.split(",") if r]
    if unknown := set(methods) - set(PRESSES):
        p.error(f"unknown presses {sorted(unknown)}")
    if not all(0 < r < 1 for r in ratios):
        p.error("keep ratios must be in (0, 1)")
    samples = [json.loads(line) for line in open(a.tasks) if line.strip()]
    if a.models:
        samples = [s for s in samples if s["model"] in a.models.split(",")]

    if a.check:
        summary = check(samples[:a.check], methods, ratios)
        if a.check_out:
            json.dump(summary, open(a.check_out, "w"), indent=1)
        print(f"check: {summary['agree']}/{summary['compared']} agree", file=sys.stderr)
        return
    if not a.out:
        p.error("--out is required (unless --check)")

    key = lambda r: (r["model"], r["length"], r["task"], r["sample"], r.get("setting", "agnostic"))  # noqa: E731
    done = defaultdict(set)  # sample -> methods already in --out (a later run may add other presses)
    for line in open(a.out) if os.path.exists(a.out) else []:
        if line.strip():
            r = json.loads(line)
            done[key(r)].add(r["method"])
    loaded = {}
    for s in sorted(samples, key=lambda s: s["model"]):
        todo = [m for m in methods if m not in done[key(s)]]
        if not todo and "full" in done[key(s)]:
            continue
        if s["model"] not in loaded:
            loaded.clear()  # one model in memory at a time
            loaded[s["model"]] = load(s["model_path"])
        model, tok = loaded[s["model"]]
        start = time.perf_counter()
        jobs, timing = run_sample(model, tok, s, todo, ratios, full_done="full" in done[key(s)])
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records(tok, s, jobs) if r["method"] not in done[key(s)])
        phases = ", ".join(f"{k} {w:.1f}s" + (f" (cpu {c:.1f}s)" if c else "") for k, (w, c) in timing.items())
        print(f"{key(s)}: {time.perf_counter() - start:.1f}s ({phases})", file=sys.stderr, flush=True)
        del jobs
        release_freed_memory()


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS between samples. glibc keeps freed blocks below its mmap
    threshold in the heap, and at 4k tokens each sample's many few-MB caches fragmented it: the runner
    grew by ~1.5 GB a sample until the OOM killer stopped it at 19.5 GB."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


if __name__ == "__main__":
    main()

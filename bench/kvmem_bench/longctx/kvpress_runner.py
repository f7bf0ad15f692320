"""The kvpress side of the benchmark race: NVIDIA kvpress's presses on the same token inputs as kvmem.

This file runs only in `.venv-race` (`make race-setup`): kvpress 0.5.5 pins transformers<5.3 and kvmem
needs 5.24, so it imports nothing from kvmem and is run by path:

    .venv-race/bin/python bench/kvmem_bench/longctx/kvpress_runner.py --tasks T.jsonl --out R.jsonl
    .venv-race/bin/python bench/kvmem_bench/longctx/kvpress_runner.py --tasks T.jsonl --check 2 --check-out C.json

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
5. FinchPress (raced as kvmem's `finch`) reads as its query the tokens after a delimiter token that its
   embedding hook drops; the harness sets that window from the sample's `query_window` instead (the question in
   aware, the context's last 32 tokens in agnostic, kvmem finch's stand-in) and runs it in step 1.
`--check N` runs kvpress's own pipeline (KVPressTextGenerationPipeline.forward) per press and ratio on N
samples and compares the compressed caches, masks and greedy tokens with this harness (FinchPress: with the
delimiter token inserted, on a model of its own whose embeddings have the delimiter's row).

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

# kvpress_presses sets the offline environment before transformers loads; run by path, this folder is on sys.path
from kvpress_presses import (PRESSES, RATIOS, FinchPress, Job, KVzipPress, answer, attention_modules,  # noqa: E402
                             clear_masks, decode, held_bytes, kvzip, make_jobs, make_press, new_cache, prefill, torch)
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline  # noqa: E402


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
    jobs = make_jobs(methods, ratios, s)
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
            pipe = pipes[job.eager]
            press = make_press(job.method, job.keep_ratio, s) if job.press is not None else None
            context_ids = s["context_ids"]
            if isinstance(press, FinchPress):  # kvpress's own flow: the delimiter before the query, dropped by its hook
                pipe = finch_pipeline(loaded[s["model"]], s["model_path"])
                press.update_model_and_tokenizer(pipe.model, pipe.tokenizer)
                at = len(context_ids) - press.window_size
                context_ids = context_ids[:at] + [press.delimiter_token_id] + context_ids[at:]
                press.window_size = None  # found again by the hook

            def generate_answer(question_ids, cache, context_length, max_new_tokens, pipe=pipe):
                # the harness's positions (after the context without the delimiter) and decoding rule
                ref["kv"] = [(layer.keys, layer.values) for layer in cache.layers]
                ref["masks"] = [getattr(m, "masked_key_indices", None) for m in attention_modules(pipe.model)]
                ref["tokens"] = decode(pipe.model, tok, cache, s, 1)[0]
                return tok.decode(ref["tokens"])

            pipe.generate_answer = generate_answer
            torch.manual_seed(s["sample"])  # the seed the harness gives every press's RNG
            try:
                pipe.forward({"context_ids": torch.tensor([context_ids]),
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


def finch_pipeline(loaded: tuple, path: str):
    """A pipeline on a model of its own for FinchPress: its update_model_and_tokenizer adds the delimiter token to
    the tokenizer and a row to the model's embeddings (and output), which the harness's model must not get."""
    pipes = loaded[2]
    if "finch" not in pipes:
        model, tok = load(path)
        pipes["finch"] = pipeline("kv-press-text-generation", model=model, tokenizer=tok)
    return pipes["finch"]


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

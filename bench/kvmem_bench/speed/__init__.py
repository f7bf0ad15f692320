"""Speed and memory benchmark: `kvmem eval --suite speed`.

Per model and context length, in one process (so machine noise hits every configuration alike):

* **prefill** time into transformers' `DynamicCache`, kvmem's `KVCache` (untracked) and `KVCache(...,
  track_attention=True)` (what h2o needs), run one after the other;
* **compress** time of every method (keep ratio 0.25, uniform budget; snapkv also adaptive) on a copy of
  the prefilled cache, the copy not timed, as a fraction of the untracked prefill (goal: <= 5%);
* **decode** ms per token (feeding the same token with `logits_to_keep=1`, as `kvmem.forward.feed`
  does) from a `DynamicCache`, a full `KVCache`, and `KVCache`s compressed to 0.25 with snapkv, uniform
  and adaptive (heads hold different numbers of tokens: the ragged storage path), interleaved step by
  step. Goal: decode from a compressed cache is no slower than from `DynamicCache`. kvmem caches drop
  their scorer observations before decoding, as `kvmem.generate.answer` does after compressing.

And **memory**, one fresh process per (model, length, cache kind): load, prefill (compressed kinds compress
each layer right after its prefill attention, via `Compressor`, which is how a user saves memory), decode
16 tokens. Peak RSS is read from /proc/self/status (VmHWM, reset after the model is loaded, so it is the
prefill + decode peak); `ru_maxrss` (the whole process, loading included) is recorded too. These processes
run with a fixed malloc mmap threshold (`SpeedConfig.malloc_mmap_threshold`, see there). The processes
are forked from multiprocessing's forkserver, not spawned from the benchmark itself, because Linux starts
a child's `ru_maxrss` at its parent's RSS (across fork and exec): from a process holding models and
caches it would report the parent's size.

SmolLM2's context is 8192 tokens: its 8192 length runs at 8192 minus the tokens decoded after it.
"""

KEEP_RATIO = 0.25
COMPRESS_GOAL = 0.05  # compression may add at most this fraction of the (untracked) prefill time
WARMUP_TOKENS = 64  # the short cache each method compresses once, untimed, before it is timed
DECODE_KINDS = ("dynamic", "kvmem-full", "snapkv-0.25", "snapkv-0.25-adaptive")
COMPRESSED_KINDS = ("snapkv-0.25", "snapkv-0.25-adaptive")
KIND_BUDGET = {"snapkv-0.25": "uniform", "snapkv-0.25-adaptive": "adaptive"}
DEFAULT_MODELS = ("smollm2-135m", "gemma3-270m")
DEFAULT_LENGTHS = (2048, 4096, 8192)

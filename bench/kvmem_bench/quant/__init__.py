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
* `tasks`: the long-context suite's usable tasks (same samples and scoring as `results/longctx`; agnostic
  setting, and aware with `--settings aware`: the question read before compression and kept, as the suite does;
  records without a setting are agnostic), each sample prefilled once at full precision; every (eviction method, keep ratio, scheme) cell
  compresses a copy, then quantizes what is kept (MiKV instead demotes what the method would evict), and is
  answered from it. HF's caches are built from the same prefilled rows (the first `update` of its layers
  quantizes them, as its own prefill would). This gives the task table and the eviction x quantization
  frontier (score against bytes held; points at >= 10x fewer bytes marked; both agnostic only).
"""

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

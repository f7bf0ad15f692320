"""Run from the repository root: .venv/bin/python results/race/fidelity-gemma-agnostic.py (about 45 min on one core).
Gemma-3 agnostic fidelity: kvmem's streaming-llm, tova and knorm scored above kvpress's (4k: +0.04 / +0.09 at keep
0.5; 8k knorm: +0.23 / +0.13 at 0.5 / 0.25). kvpress leaves Gemma-3's sliding-window layers whole, kvmem by
default evicts in them too: both rules on the same prefill, the race's first 10 samples a task, sample-major
(8k knorm first, then 4k). Found: the rule does not explain it (knorm:sliding=keep keeps kvpress's exact tokens,
one more per layer by rounding, and still scored +0.23 at 8k 0.5); the cause was the race harness feeding the
question in one forward over kvpress's compressed cache, which transformers 5.2 masks non-causally on Gemma-3
(kvpress_runner.short_layers). The records compared against are the race's after that fix."""
import json, torch
from kvmem.models import load_model
from kvmem_bench.longctx.tasks import make_samples
from kvmem_bench.longctx.runner import prefill_sample, answer_configs
torch.set_num_threads(1)
lm = load_model("gemma3-270m")
runs = [(8192, ["knorm", "knorm:sliding=keep"]),
        (4096, [m + s for m in ("streaming-llm", "tova", "knorm") for s in ("", ":sliding=keep")])]
out = open("results/race/fidelity-gemma-agnostic.jsonl", "a")
for length, methods in runs:
    samples = {t: make_samples(t, lm.tokenizer, length, 10) for t in ["fact-distractors", "fact-single", "niah-single-number"]}
    for i in range(10):
        for task, task_samples in samples.items():
            pre = prefill_sample(lm, task_samples[i], ("agnostic",), track=False)
            configs = [(m, k) for m in methods for k in (0.5, 0.25, 0.1)]
            for r in answer_configs(lm, task_samples[i], pre, configs):
                out.write(json.dumps(dict(length=length, task=task, sample=i, **r)) + "\n")
            out.flush()
            print(length, task, i, flush=True)

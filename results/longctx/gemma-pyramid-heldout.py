"""Held-out screen before the suite's run (README, "Of note", Gemma 8k): samples 30..39 of each Gemma task, which the
suite's 30 a task do not include, agnostic, keydiff:kernel_size=33:sliding=keep with its global layers' budgets uniform
and shaped by PyramidKV over them (`budget=pyramid`). Run: PYTHONPATH=bench .venv/bin/python
results/longctx/gemma-pyramid-heldout.py 8192 30 40 keydiff:kernel_size=33:sliding=keep,\
keydiff:kernel_size=33:budget=pyramid:sliding=keep 0.5,0.25,0.1 > results/longctx/gemma-pyramid-heldout.jsonl

The second screen (`gemma-kernel-heldout.jsonl`, which kernel_size to run the suite with, and whether the global
layers could share one threshold): the same samples, agnostic, methods
keydiff:kernel_size=33:budget=pyramid:sliding=keep,keydiff:kernel_size=33:budget=global:sliding=keep,\
keydiff:kernel_size=65:budget=pyramid:sliding=keep,keydiff:kernel_size=17:budget=pyramid:sliding=keep and ratios
0.25,0.1 (budget=global with keydiff is now refused by `get_method`: see its message).
"""
import json, sys
import torch
from kvmem_bench.longctx.runner import prefill_sample, answer_configs
from kvmem_bench.longctx.tasks import make_samples
from kvmem.models import load_model

torch.set_num_threads(1)
lm = load_model("gemma3-270m")
length = int(sys.argv[1]); lo, hi = int(sys.argv[2]), int(sys.argv[3])
methods = sys.argv[4].split(",")
ratios = [float(r) for r in sys.argv[5].split(",")]
configs = [("full", 1.0)] + [(m, r) for m in methods for r in ratios]
for task in ("fact-distractors", "fact-single", "niah-single-number"):
    samples = make_samples(task, lm.tokenizer, length, hi)
    for i in range(lo, hi):
        pre = prefill_sample(lm, samples[i], settings=("agnostic",), track=False)
        for r in answer_configs(lm, samples[i], pre, configs):
            print(json.dumps(dict(task=task, sample=i, method=r["method"], keep=r["keep_ratio"], score=r["score"],
                                  kv=r["kv_bytes"], out=r["output"][:20])), flush=True)

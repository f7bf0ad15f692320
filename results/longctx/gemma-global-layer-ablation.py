"""Which of Gemma-3's three global layers (5, 11, 17) breaks the answer when compressed? (README, "Of note", Gemma 8k.)

The fact-distractors samples at 8k that keydiff:kernel_size=33:sliding=keep failed at keep 0.25 (agnostic): each global
layer compressed alone at 0.25 (the others whole), and the same total (3 x 0.25) split 0.5 / 0.125 / 0.125 three ways.
The asked fact's rows were held in layers 11 and 17 (and 5 in some) on most of these, so what the answer lost was not
the fact itself. Run: PYTHONPATH=bench .venv/bin/python results/longctx/gemma-global-layer-ablation.py \
    fact-distractors 2,5,8,9,10,14,18,19 > results/longctx/gemma-global-layer-ablation.jsonl
"""
import json, sys, time
import torch
from kvmem.compress import get_method, ModelContext, compress
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples, score
from kvmem.generate import answer_batch
from kvmem.models import load_model

torch.set_num_threads(1)
lm = load_model("gemma3-270m"); tok = lm.tokenizer
task = sys.argv[1]; picks = [int(x) for x in sys.argv[2].split(",")]
VARIANTS = {"full": (1, 1, 1), "all.25": (.25, .25, .25), "only5": (.25, 1, 1), "only11": (1, .25, 1), "only17": (1, 1, .25),
            "5big": (.5, .125, .125), "11big": (.125, .5, .125), "17big": (.125, .125, .5)}
samples = make_samples(task, tok, 8192, max(picks) + 1)
m = get_method("keydiff:kernel_size=33:sliding=keep")
for i in picks:
    s = samples[i]; t0 = time.time()
    pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
    ids, (src, full) = pre.prompt.context, pre.sources["agnostic"]
    g = [li for li, layer in enumerate(src.layers) if not layer.is_sliding]
    caches = []
    for name, r in VARIANTS.items():
        cache = src.clone()
        ratios = [1.0] * len(src.layers)
        for li, x in zip(g, r): ratios[li] = x
        if min(ratios) < 1: compress(cache, m, ratios, context=ModelContext(lm, ids, pre.prompt.head))
        cache.drop_observations(); caches.append(cache)
    outs = answer_batch(lm, caches, pre.prompt.question, s.max_new_tokens, stop_at_newline=s.one_line, answers=s.answers)
    row = dict(task=task, sample=i, answer=s.answers[0], s=round(time.time() - t0))
    for name, o in zip(VARIANTS, outs):
        out = tok.decode(o); row[name] = (score(s, out), out[:16])
    print(json.dumps(row), flush=True)

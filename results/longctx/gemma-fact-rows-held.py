"""Gemma-3 8k, agnostic, keep 0.25: on fact-distractors samples keydiff:kernel_size=33:sliding=keep failed, which of the
asked fact's rows (its value, and the 12 tokens before it: the person's name and the relation) each global layer holds,
for kernel sizes 33 / 65 / 17 and plain keydiff, and what each answers. (README, "Of note", Gemma 8k.)
Run: PYTHONPATH=bench .venv/bin/python results/longctx/gemma-fact-rows-held.py fact-distractors 2,5,9,14 \
    keydiff:kernel_size=33:sliding=keep,keydiff:kernel_size=65:sliding=keep,keydiff:kernel_size=17:sliding=keep,keydiff:sliding=keep \
    > results/longctx/gemma-fact-rows-held.jsonl
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
specs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["keydiff:kernel_size=33:sliding=keep"]
KEEP = 0.25
samples = make_samples(task, tok, 8192, max(picks) + 1)
for i in picks:
    s = samples[i]
    t0 = time.time()
    pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
    ids, (src, full) = pre.prompt.context, pre.sources["agnostic"]
    val = tok(" " + s.answers[0], add_special_tokens=False).input_ids
    hits = [j for j in range(len(ids)) if ids[j:j + len(val)] == val]
    # the asked fact: the hit whose 16 tokens before mention the question's person (fact tasks) or any (niah)
    qtext = s.question
    at = None
    for j in hits:
        before = tok.decode(ids[max(0, j - 16):j])
        words = [w for w in before.replace("'s", " ").replace(".", " ").split() if w[:1].isupper()]
        if task.startswith("niah") or any(w in qtext for w in words):
            at = j
    fact = list(range(at - 12, at + len(val))) if at is not None else []
    globals_ = [li for li, layer in enumerate(src.layers) if not layer.is_sliding]
    row = dict(task=task, sample=i, answer=s.answers[0], at=at, n=len(ids), fact_text=tok.decode(ids[at - 12:at + len(val)]) if at else None,
               prefill_s=round(time.time() - t0, 1))
    ctx = ModelContext(lm, ids, pre.prompt.head)
    caches = []
    for spec in specs:
        cache = src.clone()
        compress(cache, get_method(spec), KEEP, context=ctx)
        held = {li: set(next(iter(cache.layers[li].rows.heads()))[2].tolist()) for li in globals_}
        row[spec] = dict(value_held={li: sum(j in held[li] for j in range(at, at + len(val))) for li in globals_},
                         lead_held={li: sum(j in held[li] for j in range(at - 12, at)) for li in globals_})
        cache.drop_observations()
        caches.append(cache)
    outs = answer_batch(lm, caches, pre.prompt.question, s.max_new_tokens, stop_at_newline=s.one_line, answers=s.answers)
    for spec, o in zip(specs, outs):
        out = tok.decode(o); row[spec]["out"] = out[:30]; row[spec]["score"] = score(s, out)
    print(json.dumps(row), flush=True)

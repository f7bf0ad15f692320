"""Why fastgen and attention-matching scored below random on SmolLM2 2k fact-single (README, "Of note").

For the first 4 fact-single samples at 2k, query-aware, keep 0.5 (the question protected, as the suite runs it):
* in how many of the 90 KV heads (30 layers x 3) each method keeps every token of the answer in the context, with
  what it answers; FastGen's profile (the threshold T it settled on and how many heads took each policy);
* attention-matching's old fit (`queries=window`: the last 64 observed queries, 192 a KV head) against the same
  selection without the refit (`top-t`: step 1 of the paper alone): the share of kept rows whose fitted weight is
  above the floor (MIN_WEIGHT), i.e. not silenced.
Run: PYTHONPATH=bench .venv/bin/python results/longctx/catalog-below-random.py > results/longctx/catalog-below-random.jsonl
"""

import collections
import json
import math

import torch

from kvmem.compress import ModelContext, compress, get_method
from kvmem.compress.attention_matching import MIN_WEIGHT, AttentionMatching
from kvmem.generate import answer_batch
from kvmem.models import load_model
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples, score

KEEP, SAMPLES = 0.5, 4
torch.set_num_threads(1)
lm = load_model("smollm2-135m")
tok = lm.tokenizer


class TopT(AttentionMatching):
    """attention-matching's selection without its refit (no new values, no weights)."""

    name = "top-t"

    def refit(self, head, chosen, n):
        return None


for i, s in enumerate(make_samples("fact-single", tok, 2048, SAMPLES)):
    pre = prefill_sample(lm, s, settings=("aware",), track=True)
    ids = pre.prompt.context
    answer_ids = tok(" " + s.answers[0], add_special_tokens=False).input_ids
    at = next(j for j in range(len(ids)) if ids[j:j + len(answer_ids)] == answer_ids)
    src = pre.sources["aware"][0]
    ctx = ModelContext(lm, ids, pre.prompt.head, question=pre.prompt.question[:-1])
    row = dict(sample=i, answer=s.answers[0], answer_at=at, context_tokens=len(ids))
    for spec in ("fastgen", "h2o", "snapkv", "random", "top-t", "attention-matching:queries=window"):
        method = TopT(queries="window") if spec == "top-t" else get_method(spec)
        cache = src.clone()
        compress(cache, method, KEEP, context=ctx, protect_from=len(ids))
        held = [set(p.tolist()) for layer in cache.layers for p in layer.head_positions]
        out = dict(heads_holding_answer=sum(all(j in h for j in range(at, at + len(answer_ids))) for h in held),
                   heads=len(held))
        if spec == "fastgen":
            out["threshold"] = round(method.profile["threshold"], 3)
            out["policies"] = dict(collections.Counter(p for layer in method.profile["policies"].values() for p in layer))
        if spec.startswith("attention-matching"):
            weights = torch.cat([w for layer in cache.layers for w in layer.log_weights])
            out["rows_weighted"] = round(float((weights > math.log(MIN_WEIGHT) + 1).float().mean()), 3)
        cache.drop_observations()
        text = tok.decode(answer_batch(lm, [cache], pre.prompt.question, s.max_new_tokens, stop_at_newline=True,
                                       answers=s.answers)[0])
        out.update(output=text, score=score(s, text))
        row[spec] = out
    print(json.dumps(row), flush=True)

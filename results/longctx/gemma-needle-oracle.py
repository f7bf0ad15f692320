"""Why no query-agnostic scorer passes niah-single-number on Gemma-3 270M at keep 0.25 (README, "Of note").

For the first 10 samples at 4k (agnostic prompt, sliding layers left whole, the 3 global layers at 0.25):
* which of the needle's rows kvzip and keydiff keep in each global layer, and what they answer;
* oracles that know the needle: the template head, the needle's number (and the `before` tokens ahead of
  it: the key phrase) and 2 rows after, the rest of the budget filled with the most recent rows or rows
  spread evenly over the context;
* kvzip's reconstruction scores: their quantiles per global layer and the needle rows' percentile.
Run: .venv/bin/python results/longctx/gemma-needle-oracle.py > results/longctx/gemma-needle-oracle.jsonl
"""

import json

import torch

from kvmem.compress import get_method
from kvmem.compress import ModelContext, compress
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples, score
from kvmem.generate import answer_batch
from kvmem.models import load_model

KEEP, SAMPLES = 0.25, 10
torch.set_num_threads(1)
lm = load_model("gemma3-270m")
tok = lm.tokenizer


def answer(cache, pre, sample) -> tuple[str, float]:
    cache.drop_observations()
    out = tok.decode(answer_batch(lm, [cache], pre.prompt.question, sample.max_new_tokens, stop_at_newline=True,
                                  answers=sample.answers)[0])
    return out, score(sample, out)


for i, s in enumerate(make_samples("niah-single-number", tok, 4096, SAMPLES)):
    pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
    ids, src = pre.prompt.context, pre.sources["agnostic"][0]
    number = tok(" " + s.answers[0], add_special_tokens=False).input_ids
    at = next(j for j in range(len(ids)) if ids[j:j + len(number)] == number)
    needle = range(at, at + len(number))
    globals_ = [li for li, layer in enumerate(src.layers) if not layer.is_sliding]
    row = dict(sample=i, answer=s.answers[0], needle_at=at, context_tokens=len(ids),
               needle_text=tok.decode(ids[at - 16:at + len(number)]))
    ctx = ModelContext(lm, ids, pre.prompt.head)
    for spec in ("kvzip:sliding=keep", "keydiff:sliding=keep"):
        cache = src.clone()
        compress(cache, get_method(spec), KEEP, context=ctx)
        held = {li: set(next(iter(cache.layers[li].rows.heads()))[2].tolist()) for li in globals_}
        row[spec] = dict(rows_held={li: len(held[li]) for li in globals_},
                         number_rows_held={li: sum(j in held[li] for j in needle) for li in globals_},
                         key_phrase_rows_held={li: sum(j in held[li] for j in range(at - 16, at)) for li in globals_})
        row[spec]["output"], row[spec]["score"] = answer(cache, pre, s)
    scores = get_method("kvzip:sliding=keep").pair_scores(src, ctx)  # a second replay (compress memoizes its own)
    row["kvzip_scores"] = {}
    for li in globals_:
        x = scores[li][0][pre.prompt.head:len(ids)]
        pct = lambda j: float((x < scores[li][0][j]).float().mean())  # noqa: E731
        row["kvzip_scores"][li] = dict(quantiles={q: round(float(torch.quantile(x, q)), 4) for q in (0.5, 0.75, 0.9)},
                                       needle_percentile=round(float(torch.tensor([pct(j) for j in range(at - 16, at + len(number))]).median()), 2))
    for before in (0, 16):
        for fill in ("recent", "spread"):
            cache = src.clone()
            for li in globals_:
                layer = cache.layers[li]
                n = layer.lengths()[0]
                must = set(range(pre.prompt.head)) | set(range(at - before, at + len(number) + 2))
                rest = [j for j in range(n) if j not in must]
                extra = max(0, int(KEEP * n) - len(must))
                chosen = rest[len(rest) - extra:] if fill == "recent" else rest[::max(1, len(rest) // max(extra, 1))][:extra]
                layer.keep_only([torch.tensor(sorted(must | set(chosen)))])
            out, sc = answer(cache, pre, s)
            row[f"oracle before={before} fill={fill}"] = dict(output=out, score=sc)
    print(json.dumps(row), flush=True)

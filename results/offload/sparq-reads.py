"""How much of the tier `sparq` reads (results/offload/README.md): per forward and KV head, the share of the offloaded
keys' channels its queries asked for (the question's forward, then each decoding step), and the rows decoded into the
buffer, on the first 3 samples of each task of the committed run (smollm2-135m, 2k, agnostic, keep 0.1). exact-topk
reads every channel of every row each forward (share 1.0).
Run: PYTHONPATH=bench .venv/bin/python results/offload/sparq-reads.py > results/offload/sparq-reads.jsonl
"""

import json

import torch

from kvmem.compress import ModelContext, compress, get_method
from kvmem.compress.offload import OffloadedRows
from kvmem.forward import feed
from kvmem.generate import decode
from kvmem.models import load_model
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples

torch.set_num_threads(1)
lm = load_model("smollm2-135m")
for task in ("fact-profile", "fact-single", "niah-single-number"):
    for i, s in enumerate(make_samples(task, lm.tokenizer, 2048, 3)):
        pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
        for spec in ("sparq", "sparq:channels=0.125"):
            cache = pre.sources["agnostic"][0].clone()
            compress(cache, get_method(spec), 0.1, context=ModelContext(lm, pre.prompt.context, pre.prompt.head))
            logits = feed(lm, cache, pre.prompt.question)
            decode(lm, cache, logits, s.max_new_tokens, stop_at_newline=s.one_line, answers=s.answers)
            layers = [layer.rows for layer in cache.layers if isinstance(layer.rows, OffloadedRows)]
            d = layers[0].rk[0].shape[-1]
            heads = layers[0].fixed.num_heads
            reads = torch.tensor([rows.state["channels_read"] for rows in layers], dtype=torch.float32) / d
            reads = reads.reshape(len(layers), -1, heads)  # (layers, forwards, heads)
            print(json.dumps(dict(task=task, sample=i, method=spec, question_tokens=len(pre.prompt.question),
                                  forwards=reads.shape[1], tier_rows=layers[0].tier.rows, capacity=layers[0].capacity,
                                  channels_read_question=round(float(reads[:, 0].mean()), 3),
                                  channels_read_decode=round(float(reads[:, 1:].mean()), 3) if reads.shape[1] > 1 else None,
                                  rows_decoded_per_forward=round(sum(r.decoded_rows for r in layers)
                                                                 / (len(layers) * heads * reads.shape[1]), 1))),
                  flush=True)

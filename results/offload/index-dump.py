"""Step 1 of the offline index comparison (results/offload/README.md): dump, per sample, the question forward's queries and the tier keys (int8-decoded) per layer/head, with exact-topk's path, to /tmp/off.
Run: PYTHONPATH=bench .venv/bin/python results/offload/index-dump.py 2; then .venv/bin/python results/offload/index-compare.py
"""
import os, sys, torch
from kvmem.compress import ModelContext, compress
from kvmem.compress.offload import ExactTopK
from kvmem.forward import feed
from kvmem.models import load_model
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples
torch.set_num_threads(1)
lm = load_model("smollm2-135m"); tok = lm.tokenizer
N = int(sys.argv[1])
os.makedirs("/tmp/off", exist_ok=True)
class Dump(ExactTopK):
    name = "exact-topk"
    def build_index(self, keys, positions, ids, layer):
        return {"resident": [], "state": [], "layer": layer.layer_idx}
    def retrieve(self, rows, queries, scaling):
        if queries[0].shape[1] > 1:
            every = torch.arange(rows.tier.rows)
            self.d[rows.index["layer"]] = ([q.clone() for q in queries], [rows.tier.decode_keys(h, every).clone() for h in range(len(queries))], rows.capacity, scaling)
        return super().retrieve(rows, queries, scaling)
for task in ["fact-single", "fact-profile", "niah-single-number"]:
    for i, s in enumerate(make_samples(task, tok, 2048, N)):
        pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
        cache = pre.sources["agnostic"][0].clone()
        d = Dump(); d.d = {}
        compress(cache, d, 0.1, context=ModelContext(lm, pre.prompt.context, pre.prompt.head, question=[]))
        feed(lm, cache, pre.prompt.question)
        torch.save(d.d, f"/tmp/off/dump-{task}-{i}.pt")
        print(task, i, flush=True)

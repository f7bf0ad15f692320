"""Offload diagnostic (results/offload/README.md, "Why the seeds' policies lose"): at the question forward (agnostic, keep 0.1, SmolLM2 2k), per layer and KV head, the attention
mass (question queries' mean softmax over the tier rows) that each policy's retrieval captures at its own capacity,
against exact top-k at the policy's capacity and at the index-free capacity. The forward follows exact-topk.
Run: PYTHONPATH=bench .venv/bin/python results/offload/retrieval-ranking.py sentencekv,louiskv,actqkv,ltri 2 > /tmp/diag.jsonl
"""
import json, math, sys, types
import torch
from kvmem.compress import ModelContext, compress, get_method
from kvmem.compress.offload import ExactTopK
from kvmem.compress.offload.sentencekv import ending_ids
from kvmem.forward import feed
from kvmem.models import load_model
from kvmem_bench.longctx.runner import prefill_sample
from kvmem_bench.longctx.tasks import make_samples

torch.set_num_threads(1)
lm = load_model("smollm2-135m"); tok = lm.tokenizer
POL = sys.argv[1].split(",") if len(sys.argv) > 1 else ["sentencekv", "louiskv", "actqkv", "ltri"]
TASKS = ["fact-single", "fact-profile", "niah-single-number"]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 2
KEEP = 0.1

class Probe(ExactTopK):
    name = "exact-topk"
    def __init__(self):
        super().__init__()
        self.pols = [get_method(p) for p in POL]
        for p in self.pols:
            if hasattr(p, "ending_ids"): p.ending_ids = ending_ids(tok)
        self.log = []
    def build_index(self, keys, positions, ids, layer):
        idx = []
        for p in self.pols:
            ix = p.build_index(keys, positions, ids, layer)
            rb = keys.shape[0] * 2 * keys.shape[-1] * keys.element_size()
            res = sum(t.numel() * t.element_size() for t in ix.get("resident", []))
            idx.append((ix, math.ceil(res / rb)))
        return {"resident": [], "state": [], "pol": idx, "layer": layer.layer_idx}
    def retrieve(self, rows, queries, scaling):
        chosen = super().retrieve(rows, queries, scaling)
        if queries[0].shape[1] > 1:  # the question forward
            every = torch.arange(rows.tier.rows)
            w = []
            for h, q in enumerate(queries):
                k = rows.tier.decode_keys(h, every).float()
                w.append((q.float().reshape(-1, q.shape[-1]) @ k.T * scaling).softmax(-1).mean(0))
            def mass(sel): return [float(w[h][s].sum()) for h, s in enumerate(sel)]
            def topk(cap): return [wh.topk(min(cap, wh.numel())).indices for wh in w]
            rec = {"layer": rows.index["layer"], "cap": rows.capacity, "exact": mass(topk(rows.capacity))}
            for p, (ix, cost) in zip(self.pols, rows.index["pol"]):
                cap = rows.capacity - cost
                fake = types.SimpleNamespace(index=ix, capacity=cap, state={}, tier=rows.tier)
                sel = p.retrieve(fake, queries, scaling)
                rec[p.name] = {"cap": cap, "mass": mass(sel), "exact_at_cap": mass(topk(cap))}
            self.log.append(rec)
        return chosen

out = []
for task in TASKS:
    for i, s in enumerate(make_samples(task, tok, 2048, N)):
        pre = prefill_sample(lm, s, settings=("agnostic",), track=False)
        cache = pre.sources["agnostic"][0].clone()
        probe = Probe()
        compress(cache, probe, KEEP, context=ModelContext(lm, pre.prompt.context, pre.prompt.head, question=[]))
        feed(lm, cache, pre.prompt.question)
        for rec in probe.log:
            rec.update(task=task, sample=i)
            print(json.dumps(rec), flush=True)

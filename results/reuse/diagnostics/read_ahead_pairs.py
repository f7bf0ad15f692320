# Diagnostic behind a number in the README (reuse, layer-wise pipelining). Run: PYTHONPATH=bench .venv/bin/python results/reuse/diagnostics/read_ahead_pairs.py
import gc, time, statistics, torch, tempfile
from pathlib import Path
torch.set_num_threads(1)
from kvmem.models import load_model
from kvmem.cache import KVCache
from kvmem.reuse import prefill
from kvmem.store import ChunkStore, store as storemod
from kvmem.store.tiers import DiskTier
from kvmem_bench.reuse.runner import _document, QUESTIONS, _drop_page_cache
lm = load_model("smollm2-135m")
doc, _ = _document(lm, 8192)
q1, q2 = (lm.tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS)
tmp = tempfile.mkdtemp(); tier = DiskTier(Path(tmp))
store = ChunkStore([tier], "raw", 256)
prefill(lm, KVCache(lm.model.config), doc + q1, store, context_end=len(doc))
res = {1: [], 2: []}
for i in range(5):
    for d in (1, 2):
        storemod.READ_AHEAD = d
        _drop_page_cache(); gc.collect(); t = time.perf_counter()
        _, r = prefill(lm, KVCache(lm.model.config), doc + q2, store, context_end=len(doc))
        dt = time.perf_counter() - t; res[d].append((dt, r.read_s))
        print(d, f"{dt:.3f} read {r.read_s:.3f} wait {r.wait_s:.3f}", flush=True)
print({d: (round(statistics.median(x[0] for x in v), 3), round(statistics.median(x[1] for x in v), 3)) for d, v in res.items()})

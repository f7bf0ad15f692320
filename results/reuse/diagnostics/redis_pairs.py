# Diagnostic behind a number in the README (reuse, layer-wise pipelining). Run: PYTHONPATH=bench .venv/bin/python results/reuse/diagnostics/redis_pairs.py
import gc, time, os, torch, statistics
torch.set_num_threads(1)
from kvmem.models import load_model
from kvmem.cache import KVCache
from kvmem.reuse import prefill
from kvmem.store import ChunkStore, store as storemod
storemod.READ_AHEAD = 1  # as measured (before two readers)
from kvmem.store.tiers import LocalRedis, RedisTier
from kvmem_bench.reuse.runner import _document, QUESTIONS
lm = load_model("smollm2-135m")
doc, _ = _document(lm, 8192)
q1, q2 = (lm.tokenizer(q, add_special_tokens=False).input_ids for q in QUESTIONS)
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().split(")")[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
with LocalRedis() as server:
    pid = server.process.pid if hasattr(server, "process") else int(os.popen("pgrep -n redis-server").read())
    store = ChunkStore([RedisTier(server.url)], "raw", 256)
    prefill(lm, KVCache(lm.model.config), doc + q1, store, context_end=len(doc))
    res = {True: [], False: []}
    for i in range(5):
        for ov in (False, True):
            gc.collect(); c0 = cpu(pid); t = time.perf_counter()
            _, r = prefill(lm, KVCache(lm.model.config), doc + q2, store, context_end=len(doc), overlap=ov)
            dt = time.perf_counter() - t; c1 = cpu(pid)
            time.sleep(1.0); c2 = cpu(pid)
            res[ov].append(dt)
            print(ov, f"{dt:.3f} read {r.read_s:.3f} dec {r.decode_s:.3f} imp {r.import_s:.3f} pre {r.prefill_s:.3f} wait {r.wait_s:.3f} redis cpu during {c1-c0:.2f} after {c2-c1:.2f}", flush=True)
    print({k: statistics.median(v) for k, v in res.items()})

"""A decode step of 16 rows (a ~1k-token knowledge base from a memory store, a different question each) with the
scorers' observation left on after `prepare()` (as before 2026-12-04) and dropped (now), alternated twice in one process.
The session of 2026-12-04 got: observing 351 / 318 ms, dropped 272 / 312 ms (a noisy machine; about 13 % on the mean).

    .venv/bin/python results/batching/observation-step-timing.py
"""
import time, torch
torch.set_num_threads(2)
from kvmem.models import load_model
from kvmem.generate import prepare
from kvmem.forward import step
from kvmem.batch import RowBatch
from kvmem.prompts import chat_prompt
from kvmem.store import ChunkStore
from kvmem_bench.serve.harness import knowledge_base, question_list
from kvmem.cache import KVCache
lm = load_model("smollm2-135m")
system, n, docs = knowledge_base(lm.tokenizer, 1024)
qs = question_list(docs)
store = ChunkStore("memory")
P = lambda i: chat_prompt(lm.tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": qs[i]}])
prepare(lm, P(0), store=store)
orig = KVCache.drop_observations
for r in range(2):
    for name in ("observing", "dropped"):
        KVCache.drop_observations = orig if name == "dropped" else (lambda self: None)
        cs = [prepare(lm, P(i), store=store).cache for i in range(16)]
        b = RowBatch(lm.model.config, cs); step(lm, b, [[5]] * 16)
        t = time.perf_counter()
        for _ in range(6): step(lm, b, [[5]] * 16)
        print(name, round((time.perf_counter() - t) / 6 * 1000), "ms", cs[0].layers[0].observation.active)

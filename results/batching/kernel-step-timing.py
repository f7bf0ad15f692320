"""A decode step of 8 rows of kvzip@0.5 + kivi-8 over the ~4k-token knowledge base (one computed, seven loaded from a
memory store, a different question each), in-process: the numbers of the 2026-12-04 session's kernel work (2 threads).
That session measured (the same 8 caches, saved once and reloaded): 296 ms a step with one kernel call per
layer-row, 217 ms with one call per layer for all rows, 194 ms with the residual growing by a block, 188 ms with the
values loop in registers; 1 row: 107 -> 76 ms.

    .venv/bin/python results/batching/kernel-step-timing.py
"""
import time

import torch

from kvmem.batch import RowBatch
from kvmem_bench.serve.harness import knowledge_base, question_list
from kvmem.generate import prepare
from kvmem.forward import step
from kvmem.models import load_model
from kvmem.prompts import chat_prompt
from kvmem.store import ChunkStore

torch.set_num_threads(2)
lm = load_model("smollm2-135m")
system, _, docs = knowledge_base(lm.tokenizer, 4096)
questions = question_list(docs)
store = ChunkStore("memory")
prompt = lambda i: chat_prompt(lm.tokenizer, [{"role": "system", "content": system},  # noqa: E731
                                              {"role": "user", "content": questions[i]}])
caches = [prepare(lm, prompt(i), method="kvzip", keep_ratio=0.5, quant="kivi-8", store=store).cache for i in range(8)]
for rows in (caches, caches[:1]):
    batch = RowBatch(lm.model.config, rows)
    for _ in range(3):
        step(lm, batch, [[5]] * len(rows))
    t = time.perf_counter()
    for _ in range(10):
        step(lm, batch, [[5]] * len(rows))
    print(f"{len(rows)} rows: {(time.perf_counter() - t) / 10 * 1000:.0f} ms a step")

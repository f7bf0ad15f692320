"""Run from the repository root: .venv/bin/python results/race/fidelity-gemma-4k-aware.py (about 45 min on one core).
Gemma-3 4k aware snapkv fidelity: kvpress's window/kernel (64/5), its Gemma-3 rule (sliding layers left whole:
`sliding=keep`) and its question rule (`open`: the question compressed with the context; `protect`: kvmem's,
the question kept on top of the budget) one at a time. First 10 samples a task, sample-major."""
import json, torch
from kvmem.models import load_model
from kvmem_bench.longctx.tasks import make_samples, score
from kvmem_bench.longctx.runner import prefill_sample
from kvmem.compress import compress, get_method, ModelContext
from kvmem.generate import answer_batch
torch.set_num_threads(1)
lm = load_model("gemma3-270m")
configs = [("snapkv:window=64:kernel_size=5:sliding=keep", "open"), ("snapkv:sliding=keep", "open"),
           ("snapkv:window=64:kernel_size=5", "open"), ("snapkv", "protect")]
out = open("results/race/fidelity-gemma-4k-aware.jsonl", "a")
samples = {task: make_samples(task, lm.tokenizer, 4096, 10) for task in ["fact-distractors", "fact-single", "niah-single-number"]}
for i in range(10):
    for task, task_samples in samples.items():
        s = task_samples[i]
        pre = prefill_sample(lm, s, ("aware",), track=False)
        src, full = pre.sources["aware"]
        C = len(pre.prompt.context)
        context = ModelContext(lm, pre.prompt.context, pre.prompt.head)
        rows = []
        for m, p in configs:
            for k in (0.5, 0.25, 0.1):
                c = src.clone()
                compress(c, get_method(m), k, protect_from=None if p == "open" else C, context=context)
                c.drop_observations()
                rows.append((m, p, k, c, c.kv_bytes()))
        outs = answer_batch(lm, [r[3] for r in rows], pre.prompt.question[-1:], s.max_new_tokens,
                            stop_at_newline=s.one_line, answers=s.answers)
        for (m, p, k, _, kv), toks in zip(rows, outs):
            o = lm.tokenizer.decode(toks)
            out.write(json.dumps(dict(task=task, sample=i, method=m, protect=p, keep_ratio=k, score=score(s, o),
                                      output=o, kv_bytes=kv, kv_bytes_full=full)) + "\n")
        out.flush()
        print(task, i, flush=True)

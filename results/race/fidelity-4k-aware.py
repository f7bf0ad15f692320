"""Run from the repository root: .venv/bin/python results/race/fidelity-4k-aware.py (about 50 min on one core).
SmolLM2 4k aware fidelity: does the question's protection (knorm) and kvpress's window/kernel (snapkv) explain
kvmem's lead over kvpress there? Same first 10 samples a task as the race. `protect`: kvmem's aware rule (the
question is kept on top of the budget); `open`: kvpress's (the question is compressed with the context, budget
over both); `matched`: the question kept, inside kvpress's budget."""
import json, torch
from kvmem.models import load_model
from kvmem_bench.longctx.tasks import make_samples, score
from kvmem_bench.longctx.runner import prefill_sample
from kvmem.compress import compress, get_method, ModelContext
from kvmem.generate import answer_batch
torch.set_num_threads(1)
lm = load_model("smollm2-135m")
configs = [(m, p) for m in ("knorm", "snapkv:window=64:kernel_size=5") for p in ("protect", "open")] + [("kvzip", "matched")]
out = open("results/race/fidelity-4k-aware.jsonl", "a")
samples = {task: make_samples(task, lm.tokenizer, 4096, 10) for task in ["fact-single", "niah-single-noise", "niah-single-number"]}
for i in range(10):  # sample-major, so a stopped run has every task; kvzip (a reconstruction each) on the first 5 only
    for task, task_samples in samples.items():
        s = task_samples[i]
        pre = prefill_sample(lm, s, ("aware",), track=False)
        src, full = pre.sources["aware"]
        rows = []
        C, Q = len(pre.prompt.context), len(pre.prompt.question) - 1
        context = ModelContext(lm, pre.prompt.context, pre.prompt.head)
        for m, p in configs if i < 5 else configs[:-1]:
            for k in (0.5, 0.25, 0.1):
                c = src.clone()
                # matched: the question kept, inside kvpress's budget of k * (context + question)
                ratio = (k * (C + Q) - Q) / C if p == "matched" else k
                compress(c, get_method(m), ratio, protect_from=None if p == "open" else C, context=context)
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

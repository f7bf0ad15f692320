"""Why is kvpress's prefill slower than kvmem's? One quiet-machine measurement, run in both virtualenvs.

    .venv-race/bin/python results/race/prefill-timing.py kvpress      # transformers 5.2, the runner's prefill
    .venv/bin/python results/race/prefill-timing.py kvmem             # transformers 5.25: stock SDPA and kvmem
    .venv-race/bin/python results/race/prefill-timing.py kvpress      # again (A-B-A), to see drift

Each run appends its rows to prefill-timing.jsonl (the committed file holds exactly these three runs). It reads
`results/race/tasks-all-all.jsonl`, which git ignores; make it with `kvmem_bench.longctx.race.export_tasks(
Path('results/longctx'), Path('results/race/tasks-all-all.jsonl'), settings=('agnostic', 'aware'))`.

Same token ids (the race's export, `results/race/tasks-all-all.jsonl`, agnostic setting, sample 0 and 1 of the
first task of each model @ 4096), one thread, one process at a time. Each arm prefills each sample once after
a warm-up prefill of the first sample; seconds are wall time of the forward alone.
"""

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TASKS = os.path.join(HERE, "tasks-all-all.jsonl")
OUT = os.path.join(HERE, "prefill-timing.jsonl")


def samples():
    picked, seen = [], {}
    for line in open(TASKS):
        s = json.loads(line)
        if s["length"] != 4096 or s["setting"] != "agnostic":
            continue
        task = seen.setdefault(s["model"], s["task"])
        if s["task"] == task and s["sample"] < 2:
            picked.append(s)
    return picked


def stock_cache(model):
    return DynamicCache(config=model.config) if getattr(model.config, "sliding_window", None) else DynamicCache()


@torch.no_grad()
def main(library: str) -> None:
    torch.set_num_threads(1)
    rows, by_model = [], {}
    for s in samples():
        by_model.setdefault(s["model"], []).append(s)
    for model_name, group in by_model.items():
        stock = AutoModelForCausalLM.from_pretrained(group[0]["model_path"], dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        arms = {f"transformers {__import__('transformers').__version__} sdpa, DynamicCache":
                lambda ids: stock.model(input_ids=ids, past_key_values=stock_cache(stock))}
        if library == "kvmem":
            from kvmem.cache import KVCache
            from kvmem.forward import feed
            from kvmem.models import load_model

            lm = load_model(model_name)
            arms["kvmem feed, KVCache untracked"] = lambda ids: feed(
                lm, KVCache(lm.model.config, observe_window=64, track_attention=False), ids)
        for arm, run in arms.items():
            run(torch.tensor([group[0]["context_ids"]]))  # warm-up
            for s in group:
                ids = torch.tensor([s["context_ids"]])
                start = time.perf_counter()
                run(ids)
                rows.append(dict(library=library, arm=arm, model=model_name, length=s["length"], task=s["task"],
                                 sample=s["sample"], tokens=ids.shape[1], seconds=round(time.perf_counter() - start, 3)))
                print(json.dumps(rows[-1]), flush=True)
    with open(OUT, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main(sys.argv[1])

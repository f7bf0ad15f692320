"""Could one kvpress prefill serve both settings? The aware context is the agnostic one plus the question, so
the agnostic prefill is, mathematically, the aware prefill's first n positions. This checks whether it is so
bit for bit in kvpress's environment (transformers 5.2, SDPA, float32, one thread): if it were, the race could
prefill once per sample and still reproduce its records exactly.

    .venv-race/bin/python results/race/prefix-prefill-check.py smollm2-135m 2048

Writes prefix-prefill-check.json beside this file: per layer, the largest |difference| between the agnostic
prefill's keys / values and the aware prefill's first n rows, and whether every hidden state is equal. It reads
`results/race/tasks-all-all.jsonl` (git ignores it; see prefill-timing.py for how to make it).
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

HERE = os.path.dirname(os.path.abspath(__file__))


@torch.no_grad()
def main(model_name: str, length: int) -> None:
    torch.set_num_threads(1)
    pair = {}
    for line in open(os.path.join(HERE, "tasks-all-all.jsonl")):
        s = json.loads(line)
        if (s["model"], s["length"], s["task"], s["sample"]) == (model_name, length, "fact-single", 0):
            pair[s["setting"]] = s
    agnostic, aware = pair["agnostic"], pair["aware"]
    n = len(agnostic["context_ids"])
    assert aware["context_ids"][:n] == agnostic["context_ids"]
    model = AutoModelForCausalLM.from_pretrained(agnostic["model_path"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()

    def prefill(ids):
        cache = DynamicCache(config=model.config) if getattr(model.config, "sliding_window", None) else DynamicCache()
        out = model.model(input_ids=torch.tensor([ids]), past_key_values=cache, output_hidden_states=True)
        return cache, out.hidden_states

    (cache_a, hidden_a), (cache_w, hidden_w) = prefill(agnostic["context_ids"]), prefill(aware["context_ids"])
    layers = []
    for i, (a, w) in enumerate(zip(cache_a.layers, cache_w.layers)):
        if w.keys.shape[-2] != len(aware["context_ids"]):
            continue  # a sliding layer holds its window only: its rows are not aligned with the agnostic ones
        layers.append(dict(layer=i, keys=(a.keys - w.keys[..., :n, :]).abs().max().item(),
                           values=(a.values - w.values[..., :n, :]).abs().max().item()))
    result = dict(model=model_name, length=length, agnostic_tokens=n, aware_tokens=len(aware["context_ids"]),
                  transformers=__import__("transformers").__version__,
                  hidden_states_equal=all(torch.equal(x, y[:, :n]) for x, y in zip(hidden_a, hidden_w)),
                  layers_bit_equal=sum(r["keys"] == 0 and r["values"] == 0 for r in layers), layers=layers)
    json.dump(result, open(os.path.join(HERE, "prefix-prefill-check.json"), "w"), indent=1)
    print({k: v for k, v in result.items() if k != "layers"}, max(r["keys"] for r in layers))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

"""Run from the repository root: .venv-race/bin/python results/race/question-mask-check.py (a minute).
Does kvpress's way of feeding the question (position_ids after the original context, cache_position left to
transformers) stay causal on Gemma-3 once a global layer is compressed? Change only the question's last token:
in a causal model the logits of its earlier tokens cannot change."""
import json, sys, torch
sys.path.insert(0, "src/kvmem/eval")
from kvpress_runner import load, new_cache
torch.set_num_threads(1)
s = next(x for x in map(json.loads, open("results/race/tasks-gemma3-270m-4096-8192.jsonl")) if x.get("setting", "agnostic") == "agnostic")
model, tok = load(s["model_path"])
ctx = s["context_ids"][:1200]
def run(question, compress):
    cache = new_cache(model)
    with torch.no_grad():
        model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
        if compress:  # keep every other token of the global layers, as a press would
            for layer, attn in zip(cache.layers, model.model.layers):
                if not attn.self_attn.is_sliding:
                    layer.keys, layer.values = layer.keys[:, :, ::2].contiguous(), layer.values[:, :, ::2].contiguous()
        pos = torch.arange(len(ctx), len(ctx) + len(question))[None]
        return model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=pos).logits[0]
q = s["question_ids"]
q2 = q[:-1] + [tok.convert_tokens_to_ids("the")]
for compress in (False, True):
    a, b = run(q, compress), run(q2, compress)
    print("compressed" if compress else "full", "max |logit change| at the question's tokens before the last:",
          (a[:-1] - b[:-1]).abs().max().item(), "question length", len(q))

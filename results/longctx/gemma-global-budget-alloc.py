"""Where keydiff:kernel_size=33:budget=global puts the rows of Gemma-3 2k (the 12 first shipped abstracts), against
budget=pyramid, keep 0.25, sliding layers whole: rows held per global layer. Printed (before budget=global refused
signed scorers; to rerun, bypass get_method): global [(5, [1]), (11, [1]), (17, [1534])], pyramid [(5, [997]),
(11, [512]), (17, [27])]. Run: .venv/bin/python results/longctx/gemma-global-budget-alloc.py
"""
import torch
from kvmem.models import load_model
from kvmem.cache import KVCache
from kvmem.compress import get_method
from kvmem.compress.evict import compress
from kvmem.calibration import load_abstracts
torch.set_num_threads(1)
lm = load_model("gemma3-270m")
text = "\n\n".join(load_abstracts()[:12])
ids = lm.tokenizer(text)["input_ids"][:2048]
from kvmem.forward import feed
for spec in ["keydiff:kernel_size=33:budget=global:sliding=keep", "keydiff:kernel_size=33:budget=pyramid:sliding=keep"]:
    cache = KVCache(lm.model.config); feed(lm, cache, ids)
    compress(cache, get_method(spec), 0.25)
    print(spec, [(i, layer.rows.lengths()) for i, layer in enumerate(cache.layers) if not layer.is_sliding])

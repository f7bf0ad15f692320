"""Text embeddings: from the frozen LLM kvmem serves (training-free), plus reference baselines.

One file per method on the shared base in `base.py`. `get_embedder(name, model=..., layer=...)` returns
an embedder by its canonical name (the one results use); `model` is a `kvmem.models.LoadedModel` or a
registry name, needed by the LLM methods (`mean`, `last`, `prompteol`, `echo`) only.
"""

from __future__ import annotations

from kvmem.embed.base import (PRECISIONS, Embedder, LMEmbedder, bytes_per_vector, hamming_scores, int8_scales,
                              int8_scores, quantize_embeddings)
from kvmem.embed.echo import Echo
from kvmem.embed.minilm import MiniLM
from kvmem.embed.pooling import LastToken, MeanPooling
from kvmem.embed.prompteol import PromptEOL
from kvmem.embed.tfidf import TfIdf
from kvmem.errors import KVMemError

EMBEDDERS: dict[str, type[Embedder]] = {e.name: e for e in (MeanPooling, LastToken, PromptEOL, Echo, MiniLM, TfIdf)}


def get_embedder(name: str, model=None, layer: int = -1, **options) -> Embedder:
    """An embedder by name; LLM methods need `model` (a LoadedModel or a registry name) and read `layer`."""
    if name not in EMBEDDERS:
        raise KVMemError(f"unknown embedding method {name!r}; choose from {', '.join(EMBEDDERS)}")
    cls = EMBEDDERS[name]
    if not issubclass(cls, LMEmbedder):
        return cls(**options)
    if model is None:
        raise KVMemError(f"method {name!r} embeds with an LLM: pass model= (a loaded model or a registry name)")
    if isinstance(model, str):
        from kvmem.models import load_model

        model = load_model(model)
    return cls(model.model, model.tokenizer, layer=layer, **options)


__all__ = ["EMBEDDERS", "PRECISIONS", "Embedder", "LMEmbedder", "bytes_per_vector", "get_embedder", "hamming_scores",
           "int8_scales", "int8_scores", "quantize_embeddings"]

"""Text embeddings: from the frozen LLM kvmem serves (training-free), plus reference baselines.

One file per method on the shared base in `base.py`. `get_embedder(spec, model=..., layer=...)` returns
an embedder by its name, or a spec with options such as `kv-embedding:layers=8-14:bias=1` (the spelling
results use); `model` is a `kvmem.models.LoadedModel` or a registry name, needed by the LLM methods
(`mean`, `last`, `prompteol`, `echo`, `token-prepending`, `kv-embedding`) only.
"""

from __future__ import annotations

from kvmem.embed.base import (PRECISIONS, Embedder, LMEmbedder, bytes_per_vector, hamming_scores, int8_scales,
                              int8_scores, quantize_embeddings)
from kvmem.embed.echo import Echo
from kvmem.embed.kv_embedding import KVEmbedding
from kvmem.embed.minilm import MiniLM
from kvmem.embed.pooling import LastToken, MeanPooling
from kvmem.embed.prompteol import PromptEOL
from kvmem.embed.tfidf import TfIdf
from kvmem.embed.token_prepending import TokenPrepending
from kvmem.errors import KVMemError
from kvmem.spec import check_options, parse_spec

EMBEDDERS: dict[str, type[Embedder]] = {e.name: e for e in (MeanPooling, LastToken, PromptEOL, Echo, TokenPrepending,
                                                            KVEmbedding, MiniLM, TfIdf)}


def parse_method(spec: str) -> tuple[str, dict]:
    """`name` or `name:key=value:key=value` -> (name, options) (see `kvmem.spec`), e.g.
    `kv-embedding:layers=8-14:bias=1.0`, `token-prepending:exit=4`."""
    return parse_spec(spec, EMBEDDERS, "embedding method")


def get_embedder(spec: str, model=None, layer: int = -1, **options) -> Embedder:
    """An embedder by name or spec (see `parse_method`); LLM methods need `model` (a LoadedModel or a registry
    name) and read `layer`; keyword `options` go to the method's constructor, after the spec's."""
    name, spec_options = parse_method(spec)
    options = {**spec_options, **options}
    cls = EMBEDDERS[name]
    check_options(name, cls, options, skip=("model", "tokenizer", "layer"))
    if not issubclass(cls, LMEmbedder):
        return cls(**options)
    if model is None:
        raise KVMemError(f"method {name!r} embeds with an LLM: pass model= (a loaded model or a registry name)")
    if isinstance(model, str):
        from kvmem.models import load_model

        model = load_model(model)
    return cls(model.model, model.tokenizer, layer=layer, **options)


def is_lm_method(spec: str) -> bool:
    """Whether the method embeds with an LLM (and so needs a model and has layers)."""
    return issubclass(EMBEDDERS[parse_method(spec)[0]], LMEmbedder)


__all__ = ["EMBEDDERS", "PRECISIONS", "Embedder", "LMEmbedder", "bytes_per_vector", "get_embedder", "hamming_scores",
           "int8_scales", "int8_scores", "is_lm_method", "parse_method", "quantize_embeddings"]

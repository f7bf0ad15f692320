"""Text embeddings: from the frozen LLM kvmem serves (training-free), plus reference baselines.

One file per method on the shared base in `base.py`. `get_embedder(spec, model=..., layer=...)` returns
an embedder by its name, or a spec with options such as `kv-embedding:layers=8-14:bias=1` (the spelling
results use); `model` is a `kvmem.models.LoadedModel` or a registry name, needed by the LLM methods
(`mean`, `last`, `prompteol`, `echo`, `token-prepending`, `kv-embedding`) only.
"""

from __future__ import annotations

import inspect
import re

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

EMBEDDERS: dict[str, type[Embedder]] = {e.name: e for e in (MeanPooling, LastToken, PromptEOL, Echo, TokenPrepending,
                                                            KVEmbedding, MiniLM, TfIdf)}


def parse_method(spec: str) -> tuple[str, dict]:
    """`name` or `name:key=value:key=value` -> (name, options), the one spelling used by the CLI and results.

    Values: `a-b` is the integer range a..b, `a+b+c` a list of integers, then int, float, or the raw string;
    e.g. `kv-embedding:layers=8-14:bias=1.0`, `token-prepending:exit=4`.
    """
    name, *parts = spec.strip().split(":")
    if name not in EMBEDDERS:
        raise KVMemError(f"unknown embedding method {name!r}; choose from {', '.join(EMBEDDERS)}")
    options: dict = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise KVMemError(f"bad option {part!r} in method {spec!r}: write key=value")
        options[key] = _option_value(value)
    return name, options


def _option_value(value: str):
    if re.fullmatch(r"\d+-\d+", value):
        a, b = map(int, value.split("-"))
        if a > b:
            raise KVMemError(f"empty range {value!r}: write low-high, e.g. 8-14")
        return list(range(a, b + 1))
    if re.fullmatch(r"\d+(\+\d+)+", value):
        return [int(v) for v in value.split("+")]
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def get_embedder(spec: str, model=None, layer: int = -1, **options) -> Embedder:
    """An embedder by name or spec (see `parse_method`); LLM methods need `model` (a LoadedModel or a registry
    name) and read `layer`; keyword `options` go to the method's constructor, after the spec's."""
    name, spec_options = parse_method(spec)
    options = {**spec_options, **options}
    cls = EMBEDDERS[name]
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items()
              if k not in ("self", "model", "tokenizer", "layer")}
    if unknown := sorted(set(options) - set(params)):
        raise KVMemError(f"method {name!r} has no option {', '.join(unknown)}; its options: "
                         f"{', '.join(sorted(params)) or 'none'}")
    for key, value in options.items():  # a number where the method expects one (e.g. bias=abc is an error)
        default = params[key].default
        wanted = int if type(default) is int else float if type(default) is float else None
        if wanted and (isinstance(value, bool) or not isinstance(value, (int, float) if wanted is float else int)):
            raise KVMemError(f"option {key} of {name!r} must be {'an integer' if wanted is int else 'a number'}, "
                             f"got {value!r}")
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

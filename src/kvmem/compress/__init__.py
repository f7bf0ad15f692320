"""Compression methods, one file each, on the shared base in `base.py`.

`get_method(name)` returns a method by its canonical name (the same name the CLI, results and plots use).
"""

from kvmem.compress.base import BUDGETS, CompressionResult, Compressor, HeadView, Method, compress
from kvmem.compress.full import Full
from kvmem.compress.h2o import H2O
from kvmem.compress.knorm import KNorm
from kvmem.compress.random import Random
from kvmem.compress.snapkv import SnapKV
from kvmem.compress.streaming_llm import StreamingLLM
from kvmem.compress.tova import TOVA
from kvmem.errors import KVMemError

METHODS: dict[str, type[Method]] = {m.name: m for m in (Full, Random, StreamingLLM, H2O, SnapKV, TOVA, KNorm)}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]()
    except KeyError:
        raise KVMemError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


__all__ = ["BUDGETS", "METHODS", "CompressionResult", "Compressor", "HeadView", "Method", "compress", "get_method"]

"""kvmem: make the KV cache of transformer LLMs small, reusable and useful."""

__version__ = "0.1.0"

from kvmem.cache import KVCache  # noqa: E402
from kvmem.compress import METHODS, Compressor, ModelContext, compress, get_method  # noqa: E402
from kvmem.errors import KVMemError  # noqa: E402
from kvmem.generate import answer  # noqa: E402
from kvmem.models import REGISTRY, load_model  # noqa: E402

__all__ = ["Compressor", "KVCache", "KVMemError", "METHODS", "ModelContext", "REGISTRY", "answer", "compress", "get_method", "load_model"]

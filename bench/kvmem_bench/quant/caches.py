"""The caches the quantization benchmark compares: kvmem's schemes (prepared once per model) and transformers'
QuantizedCache baselines, built empty or from the same prefilled rows, and the bytes each holds."""

from __future__ import annotations

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.quant import get_scheme
from kvmem_bench.quant import FULL, HF_BASELINES


def hf_cache(lm, name: str):
    """transformers' QuantizedCache in the setting `name` (HF_BASELINES)."""
    from transformers import QuantizedCache

    try:
        return QuantizedCache(config=lm.model.config, **HF_BASELINES[name])
    except ImportError as e:  # quanto is a dependency; say which one is missing
        raise KVMemError(f"{name} needs optimum-quanto (pip install optimum-quanto): {e}") from None


def hf_supports(lm) -> bool:
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma-3's): it has no such layer."""
    types = getattr(lm.model.config.get_text_config(), "layer_types", None) or []
    return all(t == "full_attention" for t in types)


def runnable(lm, schemes: list[str], log=print) -> list[str]:
    """The schemes that can run on `lm` (HF's baselines only where its QuantizedCache takes the model)."""
    skipped = [s for s in schemes if s in HF_BASELINES and not hf_supports(lm)]
    if skipped:
        log(f"{lm.name}: skipping {', '.join(skipped)}: transformers' QuantizedCache supports only models whose layers "
            "are all full attention")
    return [s for s in schemes if s not in skipped]


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, or of the inner tensors of a tensor subclass (quanto's packed QTensors)."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def hf_kv_bytes(cache) -> int:
    """Bytes an HF cache holds: its quantized states (if any) plus the full-precision keys and values."""
    total = 0
    for layer in cache.layers:
        for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
            for t in (q if isinstance(q, tuple) else (q,)):
                if isinstance(t, torch.Tensor):
                    total += _tensor_bytes(t)
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)
                     if isinstance(t, torch.Tensor) and t.dim() == 4)
    return total


def kv_elements(lm, cache) -> int:
    """Key and value elements the cache stands for (rows x channels), whatever it holds them as."""
    if isinstance(cache, KVCache):
        return sum(k.numel() + v.numel() for layer in cache.layers for k, v, _ in layer.rows.heads())
    text = lm.model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return sum(layer.cumulative_length * text.num_key_value_heads * 2 * head_dim for layer in cache.layers)


def held_bytes(cache) -> int:
    return cache.kv_bytes() if isinstance(cache, KVCache) else hf_kv_bytes(cache)


def new_cache(lm, name: str, prepared: dict):
    """An empty cache for `name`: kvmem's full-precision cache, a kvmem scheme (prepared once per model) or HF's."""
    if name == FULL:
        return KVCache(lm.model.config)
    if name in HF_BASELINES:
        return hf_cache(lm, name)
    return KVCache(lm.model.config, quant=prepared_scheme(lm, name, prepared))


def prepared_scheme(lm, name: str, prepared: dict):
    if name not in prepared:
        prepared[name] = get_scheme(name, lm)
    return prepared[name]


def from_rows(lm, src: KVCache, name: str, prepared: dict):
    """A cache `name` holding `src`'s rows (every head the same positions, i.e. not evicted): kvmem's quantized
    rows, or an HF cache whose first update quantizes them all, as its prefill would."""
    if name in HF_BASELINES:
        cache = hf_cache(lm, name)
        for i, layer in enumerate(src.layers):
            k, v = (torch.stack(t)[None] for t in (layer.head_keys, layer.head_values))
            cache.layers[i].update(k, v)
        return cache
    return src.clone().quantize(prepared_scheme(lm, name, prepared))

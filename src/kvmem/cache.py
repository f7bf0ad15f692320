"""kvmem's KV cache: per-head variable-length storage that keeps each token's original position.

The engine's contract (also in the README):

* `KVCache` is a transformers `Cache`. Pass it as `cache=` to a model loaded by `kvmem.load_model`
  (forward or `model.generate`); nothing in transformers is patched.
* Each layer stores, per KV head `h`, rows: keys and values (T_h, head_dim) and original positions
  (T_h,) int32 (`rows.py`). Heads may hold different numbers of rows: that is real storage, the evicted
  rows are gone. `export_rows()` / `import_rows()` move a layer's rows in and out (the chunk store).
* Keys are stored after RoPE at their original positions and never re-rotated; new tokens continue
  at the next original position. (Convention "keep original positions", as kvpress/SnapKV do;
  `rope.py` moves keys to other positions when reuse needs it.)
* Until a layer is compressed it returns exactly what transformers' DynamicLayer /
  DynamicSlidingWindowLayer would, and the model's own mask is used: output is bit-identical.
  Once compressed, the layer builds its own per-head mask from positions (causal, sliding window)
  and hands it to kvmem's attention (`attention.py`) through the attention kwargs.
* Scorers need what attention saw: each layer's `observation` (`observe.py`) keeps the last
  `observe_window` queries (and their positions) and, with `track_attention=True`, the attention each
  kept row has received (H2O), or with `attention_decay` < 1 its momentum (Moment-KV).
* `kv_bytes()` sums the storage actually held by key and value tensors; positions and observation
  state are reported separately by `state_bytes()`.

A sequence is one batch row: kvmem caches hold batch size 1.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvmem.attention import ATTENTION_NAME  # noqa: F401  (importing registers kvmem's attention)
from kvmem.errors import KVMemError
from kvmem.layer import KVLayer
from kvmem.quant.base import Scheme


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view of a big tensor counts the big tensor)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _check_scheme(quant) -> None:
    """The cache sits below the schemes (`kvmem.quant` builds on it): it takes a scheme made by `get_scheme`."""
    if quant is not None and not isinstance(quant, Scheme):
        raise KVMemError(f"quant takes a scheme, not {quant!r}: kvmem.quant.get_scheme({quant!r}) makes one "
                         f"(or kvmem.generate.new_cache(lm, method, quant={quant!r}) for a model's cache)")


class KVCache(Cache):
    """A transformers Cache made of `KVLayer`s, one per decoder layer (sliding layers where the model has them)."""

    def __init__(self, config, observe_window: int = 64, track_attention: bool = False, compressor=None,
                 quant: Scheme | None = None, attention_decay: float = 1.0):
        """`compressor` (a `kvmem.compress.Compressor`) makes the cache compress itself after the prefill
        and optionally every N decode steps; the observation it needs is switched on. `quant` (a scheme,
        `kvmem.quant.get_scheme("kivi-2")`) holds every layer's rows quantized. `attention_decay` (in (0, 1]) is
        how tracked attention decays per query step (`observe.py`; a compressor's method sets it)."""
        _check_scheme(quant)
        if compressor is not None:
            observe_window = max(observe_window, compressor.method.observe_window, 1)
            track_attention = track_attention or compressor.method.needs_attention
            if compressor.method.needs_attention:
                attention_decay = compressor.method.attention_decay
        if not 0.0 < attention_decay <= 1.0:
            raise KVMemError(f"attention_decay must be in (0, 1] (the momentum of tracked attention); got {attention_decay}")
        text = config.get_text_config()
        n_layers = text.num_hidden_layers
        if quant is not None:
            quant.check(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
            if not quant.ready:
                raise KVMemError(f"{quant.spec} is fitted per model: make it with kvmem.quant.get_scheme("
                                 f"'{quant.spec}', lm) or use kvmem.new_cache(lm, ..., quant='{quant.spec}')")
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * n_layers
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise KVMemError(f"unsupported attention layer types {sorted(unknown)}")
        if compressor is not None:  # its state belongs to this cache; budgets depend on the layers it compresses
            compressor = compressor.bind([t == "sliding_attention" for t in layer_types[:n_layers]])
        layers = [
            KVLayer(text.sliding_window if t == "sliding_attention" else None, observe_window, track_attention, i,
                    compressor, quant.for_layer(i) if quant is not None else None, attention_decay)
            for i, t in enumerate(layer_types[:n_layers])
        ]
        super().__init__(layers=layers)

    def kv_bytes(self) -> int:
        """Bytes held by key and value tensors (measured from their storages)."""
        return storage_bytes(t for layer in self.layers for t in layer.kv_tensors())

    def offloaded_bytes(self) -> int:
        """Bytes held in offloaded layers' slower tier (compress/offload/), measured; `kv_bytes` counts what is
        resident."""
        return storage_bytes(t for layer in self.layers if layer.is_initialized
                             for t in getattr(layer.rows, "offloaded_tensors", list)())

    def retrieved_peak_bytes(self) -> int:
        """The most bytes offloaded layers' retrieved rows have held at once, summed over layers (measured after each
        retrieval): what the resident working set adds to `kv_bytes` taken right after offloading."""
        return sum(getattr(layer.rows, "peak_retrieved_bytes", 0) for layer in self.layers if layer.is_initialized)

    def state_bytes(self) -> int:
        """Bytes of positions and scorer observations held beside the KV."""
        return storage_bytes(t for layer in self.layers for t in layer.state_tensors())

    def forward_inputs(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """The tokens (1, n') a forward over `ids` (1, n) runs on this cache and their positions (1, n'), None for the
        next ones: `ids` as they are. A KV-Direct cache (`kvdirect.py`) runs its checkpointed tokens again before them."""
        return ids, None

    def tokens_held(self) -> list[list[int]]:
        """Tokens held per layer and KV head."""
        return [layer.lengths() for layer in self.layers]

    def quantize(self, scheme: Scheme) -> "KVCache":
        """Hold every layer's rows quantized by `scheme` from now on (e.g. after a full-precision prefill and
        compression: the same rows a `KVCache(quant=...)` would have encoded). Returns the cache."""
        _check_scheme(scheme)
        if not scheme.ready:
            raise KVMemError(f"{scheme.spec} is fitted per model: make it with kvmem.quant.get_scheme('{scheme.spec}', lm)")
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                scheme.check(layer.head_keys[0].shape[-1])
            layer.quantize(scheme.for_layer(i))
        return self

    def clone(self) -> "KVCache":
        """An independent copy (tensors copied), e.g. to try several compressions on one prefill."""
        return copy.deepcopy(self)

    def drop_observations(self) -> None:
        """Free scorer state (recent queries, accumulated attention) once no more compression is planned."""
        for layer in self.layers:
            layer.observation.stop()


def check_supported(model) -> None:
    """Probe the model with 3 tokens: it must be causal (changing the last token leaves the earlier
    logits alone) and every layer must go through kvmem's cache and attention."""
    try:
        with torch.no_grad():
            a = model(input_ids=torch.tensor([[1, 2, 3]], device=model.device)).logits[0, :2]
            b = model(input_ids=torch.tensor([[1, 2, 4]], device=model.device)).logits[0, :2]
        if not torch.allclose(a, b, atol=1e-4):
            raise KVMemError(f"{type(model).__name__} is not causal (a decoder-only LM); kvmem cannot cache it")
        cache = KVCache(model.config, observe_window=1)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]], device=model.device), cache=cache, use_cache=True)
    except KVMemError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure here means the architecture is not one kvmem can drive
        raise KVMemError(f"{type(model).__name__} is unsupported: a probe forward with a kvmem cache failed "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    missing = [i for i, layer in enumerate(cache.layers) if layer.observation.recent_queries is None]
    if missing:
        raise KVMemError(
            f"{type(model).__name__} does not route attention through kvmem's cache in layers {missing[:5]}; unsupported model"
        )

"""KV-Direct: hold residual-stream checkpoints instead of the KV of old tokens, and recompute their keys and values on
demand.

Paper: Qasim, Zhang, Shaheen, Alharith 2026, "The Residual Stream Is All You Need: On the Redundancy of the KV Cache in
Transformer Inference" (KV-Direct; https://github.com/Kaleemullahqasim/KV-Direct, which holds the README and the
method diagram only: its code is "coming soon", so this file follows the abstract and the diagram). Keys and values
at layer l are deterministic functions of the residual stream h_l entering that layer: K = RoPE(k_norm(W_k
RMSNorm(h_l))), V = W_v RMSNorm(h_l). KV-Direct keeps the last `window` tokens' K/V resident (the "active cache",
budget B) and, for the tokens that leave it, a residual checkpoint from which their K/V are recomputed at every
forward and dropped again.

The paper's abstract and its diagram disagree on what one checkpoint is, so both are here (`checkpoint=`):

* `layer` (the diagram: "evict, store h_l"; recompute "RMSNorm(h) . W_k, W_v"): every layer holds h_l, hidden_size
  floats per token, for every token (a token's h_l exists only while it is fed, so it is kept from then on; the
  projection is not invertible). Recomputing is cheap, one norm and two projections over the old rows per layer and
  forward. But it is not smaller than the KV it replaces on grouped-query models: hidden_size against
  2 x kv_heads x head_dim per token and layer, 576 against 384 on SmolLM2-135M (1.5x), 640 against 512 on
  Gemma-3-270M (1.25x). A sliding-window layer keeps only the residuals its next tokens can still see.
* `tokens` (the abstract: "a single residual vector per token", 5 KB a token on Gemma 3-4B, i.e. one hidden_size
  vector for the whole stack): the one residual from which every layer's K/V follow is the stack's input, the
  embedding of the token, itself a function of the token id, so the id is held (4 bytes a token) and the checkpointed
  tokens are run through the whole stack again at each forward, before the new tokens and in the same forward,
  their K/V computed layer by layer, read by the new tokens' attention, and dropped. Memory held is bounded (the
  window's KV, plus 4 bytes a token); each forward costs a prefill of the checkpointed tokens.

What is held is measured from the tensors: `kv_bytes()` (the resident K/V), `checkpoint_bytes()` (residuals or ids),
`held_bytes()` (both). `recompute_s` is the time spent recomputing (layer mode: the projections; tokens mode: not
separable from the forward, `refed_tokens` counts the rows run again).

Exactness: the prefill is transformers' own path (bit-identical to a full cache); later forwards attend through
kvmem's attention with a mask from positions. Recomputed K/V equal those the full cache holds up to the summation
order of the linear layers (`models.FewRowsLinear` takes 1-64 rows through its own kernel, more through MKL): bit for
bit where both passes used the same kernel (tested), ~1e-6 relative otherwise. Greedy output matches the full cache
token for token (tested on SmolLM2 and Gemma 3).

Not supported (each refused by name): quantized rows, eviction methods on top, the chunk store, query-aware
compression, copying a cache (it refers to its model), batching several sequences (`RowBatch`, the server).
"""

from __future__ import annotations

import time
import weakref

import torch
from torch import Tensor

from kvmem.attention import rows_mask
from kvmem.cache import KVCache, storage_bytes
from kvmem.errors import KVMemError
from kvmem.layer import KVLayer
from kvmem.models import LoadedModel
from kvmem.rope import angles, apply_rotation, rope_frequencies
from kvmem.rows import GROW
from kvmem.spec import check_options, format_spec, parse_spec

NAME = "kv-direct"
CHECKPOINTS = ("layer", "tokens")


def is_kv_direct(spec: str) -> bool:
    """Whether a method spec names KV-Direct (`kv-direct` or `kv-direct:window=N:checkpoint=...`)."""
    return isinstance(spec, str) and spec.strip().split(":")[0] == NAME


class Options:
    """KV-Direct's options: `window` tokens whose K/V stay resident (>= 1), `checkpoint` what the older tokens keep
    (`layer`: each layer's input residual; `tokens`: the token ids, the stack run again)."""

    def __init__(self, window: int = 256, checkpoint: str = "layer"):
        if window < 1:
            raise KVMemError(f"{NAME}: window must be at least 1 (the tokens whose K/V stay resident); got {window}")
        if checkpoint not in CHECKPOINTS:
            raise KVMemError(f"{NAME}: checkpoint={checkpoint!r}; choose {' or '.join(CHECKPOINTS)}")
        self.window, self.checkpoint = window, checkpoint

    @property
    def spec(self) -> str:
        return format_spec(NAME, {"window": self.window, "checkpoint": self.checkpoint})


def parse(spec: str) -> Options:
    """`kv-direct[:window=N][:checkpoint=layer|tokens]` -> its options (a clear error for anything else)."""
    _, options = parse_spec(spec, (NAME,), "method")
    check_options(NAME, Options, options)
    return Options(**options)


def check_call(spec: str, keep_ratio: float = 1.0, quant=None, store=None, query_aware: bool = False) -> Options:
    """KV-Direct's options, and a clear refusal of what it does not combine with (before a model is loaded)."""
    options = parse(spec)
    if keep_ratio != 1.0:
        raise KVMemError(f"{NAME} keeps every token (its memory is set by window=N, not a keep ratio): give keep ratio 1.0")
    if quant:
        raise KVMemError(f"{NAME} holds full-precision K/V and residuals; it does not take quant={quant!r}")
    if store is not None:
        raise KVMemError(f"{NAME} is not stored in or reused from a chunk store; run it without a store")
    if query_aware:
        raise KVMemError(f"{NAME} compresses nothing before the question; query_aware does not apply")
    return options


class KVDirectLayer(KVLayer):
    """One layer: the resident window's K/V in `rows` (dense storage), and in layer mode the residuals h_l of every
    token it may still have to recompute (`residual`, positions `res_start`.. in order)."""

    def __init__(self, sliding_window: int | None, layer_idx: int, window: int, project=None):
        super().__init__(sliding_window, observe_window=1, layer_idx=layer_idx)
        self.window = window
        self.project = project  # layer mode: (h (T, hidden), positions (T,)) -> keys, values (H, T, D)
        self.pending: Tensor | None = None  # this forward's input residuals (n, hidden), set by the decoder layer's hook
        self.refed = 0  # tokens mode: leading rows of this forward that are checkpointed tokens run again
        self.armed = False  # tokens mode: the cache's forward_inputs prepared this forward (set there, cleared here)
        self.residual: Tensor | None = None  # (capacity, hidden)
        self.res_n = 0
        self.res_start = 0  # position of residual row 0
        self.recompute_s = 0.0
        self.last_recomputed: tuple[Tensor, Tensor, Tensor] | None = None  # keys, values, positions (for tests)
        self.first_kv_bytes: int | None = None  # K/V held after the first forward, before the window was cut

    def checkpoint_tensors(self) -> list[Tensor]:
        return [self.residual] if self.residual is not None else []

    def _append_residual(self, h: Tensor) -> None:
        n = h.shape[0]
        if self.residual is None:
            self.residual = torch.empty((n + GROW, h.shape[1]), dtype=h.dtype, device=h.device)
        elif self.res_n + n > self.residual.shape[0]:
            bigger = torch.empty((self.res_n + n + GROW, h.shape[1]), dtype=h.dtype, device=h.device)
            bigger[:self.res_n] = self.residual[:self.res_n]
            self.residual = bigger
        self.residual[self.res_n:self.res_n + n] = h
        self.res_n += n

    def _drop_residual_before(self, position: int) -> None:
        """Free the residuals of positions < `position` (a sliding layer's, once no later token can see them)."""
        d = min(max(position - self.res_start, 0), self.res_n)
        if d:
            self.residual = self.residual[d:self.res_n].clone()  # exact storage: the dropped rows are freed
            self.res_n -= d
            self.res_start += d

    def _old_rows(self, key_states: Tensor, value_states: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """The checkpointed tokens' keys, values and positions for this forward: recomputed from the residuals (layer
        mode) or the leading rows of this forward (tokens mode); None when there are none."""
        if self.refed:
            return key_states[0, :, :self.refed], value_states[0, :, :self.refed], pos[:self.refed]
        if self.project is None or self.rows is None:
            return None
        first_resident = int(self.rows.positions()[0][0]) if self.rows.lengths()[0] else self.next_position
        n_old = first_resident - self.res_start
        if n_old <= 0:
            return None
        t = time.perf_counter()
        positions = torch.arange(self.res_start, first_resident, dtype=torch.int32, device=self.device)
        keys, values = self.project(self.residual[:n_old], positions)
        self.recompute_s += time.perf_counter() - t
        self.last_recomputed = (keys, values, positions)
        return keys, values, positions

    def update(self, key_states: Tensor, value_states: Tensor, *args, kwargs: dict | None = None, **_) -> tuple[Tensor, Tensor]:
        if key_states.shape[0] != 1:
            raise KVMemError(f"a kvmem cache holds one sequence; got batch size {key_states.shape[0]}")
        if kwargs is None:
            raise KVMemError("this model does not pass its attention kwargs to the cache; kvmem cannot drive it")
        if self.project is not None and self.pending is None:
            raise KVMemError(f"{NAME}: layer {self.layer_idx} got no residual; feed a KV-Direct cache with "
                             "kvmem.forward.feed (the model loaded by kvmem.load_model)")
        if self.project is None and not self.armed and self.next_position > self.window:
            raise KVMemError(f"{NAME}:checkpoint=tokens runs its checkpointed tokens again before the new ones: feed it "
                             "with kvmem.forward.feed (or decode / answer), not the model directly")
        self.armed = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        position_ids = kwargs.get("position_ids")
        pos = (position_ids.reshape(-1)[-n:].to(device=self.device, dtype=torch.int32) if position_ids is not None else
               torch.arange(self.next_position, self.next_position + n, dtype=torch.int32, device=self.device))
        old = self._old_rows(key_states, value_states, pos)
        new_pos = pos[self.refed:]
        if self.project is not None:
            self._append_residual(self.pending.reshape(-1, self.pending.shape[-1])[-len(new_pos):])
            self.pending = None
        self.rows.append(key_states[0, :, self.refed:], value_states[0, :, self.refed:], new_pos)
        self.next_position = int(new_pos.max()) + 1
        keys, values, positions = self.rows.stacked()
        if old is not None:
            keys, values = torch.cat([old[0], keys], 1), torch.cat([old[1], values], 1)
            positions = torch.cat([old[2][None].expand(keys.shape[0], -1), positions], 1)
            self.compressed = True
        if self.compressed:  # kvmem's attention with the mask from positions (the model's assumes a contiguous cache)
            mask = rows_mask(positions, pos, self.sliding_window)
            kwargs["kvmem_mask"] = None if mask is None else mask[None]
        if self.first_kv_bytes is None:
            self.first_kv_bytes = storage_bytes(self.rows.kv_tensors())
        self._trim()
        return keys[None], values[None]

    def _trim(self) -> None:
        """Keep the last `window` tokens' K/V resident (a sliding layer: no more than it can still see); in layer mode
        a sliding layer also frees the residuals no later token can see."""
        lo = self.next_position - self.window
        if self.is_sliding:
            lo = max(lo, self.next_position - self.sliding_window + 1)
            if self.project is not None:
                self._drop_residual_before(self.next_position - self.sliding_window + 1)
        held = self.rows.lengths()[0]
        drop = max(0, held - (self.next_position - max(lo, 0)))
        if drop:
            self.rows = self.rows.keep([torch.arange(drop, held, device=self.device)] * self.rows.num_heads)
            self.compressed = True

    def reset(self) -> None:
        self.__init__(self.sliding_window, self.layer_idx, self.window, self.project)

    def export_rows(self):
        raise KVMemError(f"{NAME} layers hold a window and checkpoints, not rows to export")

    def import_rows(self, *args, **kwargs):
        raise KVMemError(f"{NAME} layers hold a window and checkpoints; rows cannot be imported into them")


def _projector(lm: LoadedModel, layer: int):
    """Layer `layer`'s keys and values from its input residuals, the model's own modules in the model's order:
    input RMSNorm, k/v projections (+ bias), QK-norm on keys where the model has it (Gemma 3), RoPE at the tokens'
    original positions with the layer type's frequencies and scaling (`rope.py`)."""
    decoder = lm.model.model.layers[layer]
    attn = decoder.self_attn
    head_dim = attn.head_dim
    inv_freq = rope_frequencies(lm.model, layer)
    rotary = lm.model.model.rotary_emb
    layer_types = getattr(lm.model.config.get_text_config(), "layer_types", None)
    scaling = getattr(rotary, f"{layer_types[layer]}_attention_scaling", None) if layer_types else None
    scaling = float(scaling if scaling is not None else getattr(rotary, "attention_scaling", 1.0))

    def project(h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        x = decoder.input_layernorm(h[None])
        shape = (1, h.shape[0], -1, head_dim)
        keys = attn.k_proj(x).view(shape).transpose(1, 2)
        values = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "k_norm"):
            keys = attn.k_norm(keys)
        cos, sin = angles(positions, inv_freq)  # float32, as the model's rotary embedding computes them
        cos, sin = (cos * scaling).to(keys.dtype), (sin * scaling).to(keys.dtype)
        return apply_rotation(keys, cos, sin)[0], values[0]

    return project


_HOOKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hook_residuals(lm: LoadedModel) -> None:
    """Once per model: each decoder layer hands its input residual to the KV-Direct cache its forward runs on (any
    other forward passes through unchanged; the hook reads, it changes nothing)."""
    if lm.model in _HOOKED:
        return

    def capture(i: int):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if isinstance(cache, KVDirectCache) and cache.options.checkpoint == "layer":
                cache.layers[i].pending = args[0] if args else kwargs["hidden_states"]
        return hook

    _HOOKED[lm.model] = [layer.register_forward_pre_hook(capture(i), with_kwargs=True)
                         for i, layer in enumerate(lm.model.model.layers)]


class KVDirectCache(KVCache):
    """A `KVCache` whose layers keep the last `window` tokens' K/V and residual checkpoints of the rest (`checkpoint`:
    `layer` or `tokens`, see the module's docstring). Fed by `kvmem.forward.feed` (and so `answer`, `decode`)."""

    def __init__(self, lm: LoadedModel, window: int = 256, checkpoint: str = "layer"):
        self.options = Options(window, checkpoint)
        super().__init__(lm.model.config, observe_window=1)
        text = lm.model.config.get_text_config()
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        layer_mode = checkpoint == "layer"
        if layer_mode:
            _hook_residuals(lm)
        self.layers = [KVDirectLayer(text.sliding_window if t == "sliding_attention" else None, i, window,
                                     _projector(lm, i) if layer_mode else None)
                       for i, t in enumerate(layer_types[:text.num_hidden_layers])]
        self.ids: Tensor | None = None  # tokens mode: every token fed (int32), the checkpoints of the old ones
        self.refed_tokens = 0

    @property
    def recompute_s(self) -> float:
        return sum(layer.recompute_s for layer in self.layers)

    @property
    def prefill_kv_bytes(self) -> int:
        """K/V the layers held after the first forward (the prompt's, measured) before they cut it to the window: what
        a full cache holds for it."""
        return sum(layer.first_kv_bytes or 0 for layer in self.layers)

    def checkpoint_bytes(self) -> int:
        """Bytes of the checkpoints held (residuals, or token ids), measured from their storages."""
        tensors = [t for layer in self.layers for t in layer.checkpoint_tensors()]
        return storage_bytes(tensors + ([self.ids] if self.ids is not None else []))

    def held_bytes(self) -> int:
        """What KV-Direct holds in place of a full KV cache: the resident K/V and the checkpoints."""
        return self.kv_bytes() + self.checkpoint_bytes()

    def forward_inputs(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        start = self.get_seq_length()
        n = ids.shape[1]
        positions = torch.arange(start, start + n, device=ids.device)
        refed = 0
        if self.options.checkpoint == "tokens":
            refed = max(start - self.options.window, 0)  # every token that left the window is run again, first
            new = ids[0].to(torch.int32).cpu()
            self.ids = new.clone() if self.ids is None else torch.cat([self.ids, new])
            if refed:
                ids = torch.cat([self.ids[:refed].to(ids.device, ids.dtype)[None], ids], 1)
                positions = torch.cat([torch.arange(refed, device=ids.device), positions])
                self.refed_tokens += refed
        for layer in self.layers:
            layer.refed, layer.armed = refed, True
        return ids, positions[None]

    def clone(self) -> "KVCache":
        raise KVMemError(f"a {NAME} cache refers to its model's layers (to recompute K/V); it cannot be copied")


def new_cache(lm: LoadedModel, spec: str) -> KVDirectCache:
    """A KV-Direct cache for `lm` from a spec (`kv-direct:window=256:checkpoint=layer`)."""
    o = parse(spec)
    return KVDirectCache(lm, o.window, o.checkpoint)

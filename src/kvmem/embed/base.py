"""The shared base of embedders: `_embed` a batch -> `encode` with sentence-transformers' interface.

`Embedder.encode(texts, batch_size, normalize_embeddings, precision, show_progress_bar)` behaves like
`SentenceTransformer.encode`: numpy out, one row per text (1-D for a single string). Texts are sorted by
length before batching (less padding) and put back in order; embeddings do not depend on the batch.

Quantization (the memory/quality trade of Shakir et al. 2024, sentence-transformers' `quantize_embeddings`):
- `int8`: per-dimension *symmetric* scalar quantization, calibrated: scale_d = max|x_d| / 127 over the
  calibration embeddings (the embeddings themselves unless given), codes = round(x / scale) in [-127, 127].
  Symmetric (zero stays zero) rather than sentence-transformers' min-max buckets, so an integer dot product
  is meaningful; it equals the float dot product with each dimension divided by its scale (a per-dimension
  rescaling, as z-scoring would do). Score with `int8_scores`.
- `binary`: the sign bit of each dimension (x > 0), packed 8 per byte with `np.packbits` (uint8, dim/8 bytes).
  Score with `hamming_scores` (higher = more similar).

`LMEmbedder` is the base of embedders that read hidden states of a frozen causal LM (right padding plus
an attention mask; a causal model's real tokens never see the padding, so batching changes nothing).
"""

from __future__ import annotations

import threading
from typing import ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from kvmem.errors import KVMemError

PRECISIONS = ("float32", "int8", "binary")


def bytes_per_vector(dim: int, precision: str) -> int:
    """Storage of one embedding of `dim` dimensions."""
    _check_precision(precision)
    return {"float32": 4 * dim, "int8": dim, "binary": (dim + 7) // 8}[precision]


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise KVMemError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")


def int8_scales(calibration: np.ndarray) -> np.ndarray:
    """Per-dimension scale of symmetric int8 quantization: max |x_d| / 127 (never 0)."""
    return np.maximum(np.abs(calibration).max(axis=0), 1e-12).astype(np.float32) / 127.0


def quantize_embeddings(embeddings: np.ndarray, precision: str, calibration: np.ndarray | None = None) -> np.ndarray:
    """float32 (n, dim) -> float32 / int8 (n, dim) / packed-bit uint8 (n, ceil(dim / 8)); see the module doc."""
    _check_precision(precision)
    x = np.asarray(embeddings, dtype=np.float32)
    if precision == "float32":
        return x
    if precision == "binary":
        return np.packbits(x > 0, axis=-1)
    scale = int8_scales(x.reshape(-1, x.shape[-1]) if calibration is None else np.asarray(calibration))
    return np.clip(np.rint(x / scale), -127, 127).astype(np.int8)


def int8_scores(queries: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Integer dot products of int8 codes: (nq, nd) int64."""
    return queries.astype(np.int64) @ docs.astype(np.int64).T


def hamming_scores(queries: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Similarity of packed sign bits: number of equal bits (= bits - Hamming distance), (nq, nd) int64."""
    bits = 8 * queries.shape[-1]
    out = np.empty((len(queries), len(docs)), dtype=np.int64)
    for i in range(0, len(queries), 256):  # (256, nd, bytes) at a time
        xor = np.bitwise_xor(queries[i:i + 256, None, :], docs[None, :, :])
        out[i:i + 256] = bits - np.bitwise_count(xor).sum(axis=-1, dtype=np.int64)
    return out


def this_thread_only(hook):
    """`hook` (a forward or pre-forward hook) acting only on forwards run by the thread that made it. The model is
    shared by concurrent requests (the server runs each in its own thread); an embedder's hooks belong to its
    request, so another request's forward, on another thread, passes through them unchanged."""
    owner = threading.get_ident()

    def hook_for_owner(*args, **kwargs):
        return hook(*args, **kwargs) if threading.get_ident() == owner else None
    return hook_for_owner


def check_template(template: str, copies: int, method: str) -> str:
    """A prompt template must hold `{text}` exactly `copies` times and no other format field."""
    times = {1: "once", 2: "twice"}.get(copies, f"{copies} times")
    if not isinstance(template, str) or template.count("{text}") != copies:
        raise KVMemError(f"a {method} template needs {{text}} exactly {times}, got {template!r}")
    try:
        template.format(text="")
    except (KeyError, IndexError, ValueError):
        raise KVMemError(f"the {method} template {template!r} has braces other than {{text}} "
                         "(write a literal brace twice: {{ or }})") from None
    return template


class Embedder:
    """Base class: subclasses set `name` and implement `_embed`; `fit` is for methods fitted on a corpus."""

    name: ClassVar[str]

    def _embed(self, texts: list[str]) -> Tensor:
        """float32 (len(texts), dim) for one batch."""
        raise NotImplementedError

    def fit(self, docs: Sequence[str]) -> "Embedder":
        """Fit on the documents to be searched (a no-op unless the method needs it, e.g. tfidf)."""
        return self

    @torch.no_grad()
    def encode(self, texts: str | Sequence[str], batch_size: int = 8, normalize_embeddings: bool = False,
               precision: str = "float32", show_progress_bar: bool = False,
               calibration: np.ndarray | None = None) -> np.ndarray:
        """Embed `texts` like `SentenceTransformer.encode`; `calibration` (float32 embeddings) sets int8 scales."""
        _check_precision(precision)
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        if not texts:
            raise KVMemError("nothing to embed: got an empty list of texts")
        if any(not isinstance(t, str) or not t.strip() for t in texts):
            raise KVMemError("cannot embed an empty (or non-string) text")
        if batch_size < 1:
            raise KVMemError(f"batch_size must be >= 1, got {batch_size}")
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        chunks = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        out: list[Tensor | None] = [None] * len(texts)
        for chunk in tqdm(chunks, desc=f"embed {self.name}", disable=not show_progress_bar):
            for i, row in zip(chunk, self._embed([texts[i] for i in chunk]).float()):
                out[i] = row
        emb = torch.stack(out)
        if normalize_embeddings:
            emb = torch.nn.functional.normalize(emb, dim=-1)
        result = quantize_embeddings(emb.cpu().numpy(), precision, calibration)
        return result[0] if single else result

    def __repr__(self) -> str:
        return self.name


class LMEmbedder(Embedder):
    """An embedder reading the hidden states of a frozen causal LM at `layer`.

    `layer` counts like `output_hidden_states`: 0 is the token embeddings, `n_layers` (or -1, the default)
    the last layer's output (after the final norm, as transformers returns it).
    """

    def __init__(self, model, tokenizer, layer: int = -1):
        self.model, self.tokenizer = model, tokenizer
        n = model.config.get_text_config().num_hidden_layers
        if not -(n + 1) <= layer <= n:
            raise KVMemError(f"layer {layer} out of range for a model with {n} layers (use 0..{n} or -1)")
        self.layer = layer % (n + 1)
        self.n_layers = n

    def _texts(self, texts: list[str]) -> list[str]:
        """The prompt actually fed to the model for each text (templates override this)."""
        return texts

    def _pool(self, hidden: Tensor, mask: Tensor, batch, texts: list[str]) -> Tensor:
        """(B, T, D) hidden states of one layer, the (B, T) mask, the tokenized batch (with
        `offset_mapping`) and the raw texts -> (B, D)."""
        raise NotImplementedError

    def _tokenize(self, texts: list[str]):
        """The right-padded batch of prompts, with `offset_mapping` (methods that edit the input override this)."""
        tok = self.tokenizer
        if tok.pad_token is None:  # any id will do: padding is masked and comes after the text
            tok.pad_token = tok.eos_token
        return tok(self._texts(texts), return_tensors="pt", padding=True, padding_side="right",
                   return_offsets_mapping=True)

    def _hidden_states(self, batch) -> tuple[Tensor, ...]:
        """All layers' hidden states of one batch (methods that change the forward pass override this)."""
        body = self.model.base_model  # the decoder without the LM head: no logits to compute
        return body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_hidden_states=True, use_cache=False).hidden_states

    def _forward(self, texts: list[str], layers: Sequence[int]) -> list[Tensor]:
        batch = self._tokenize(texts)
        limit = self.model.config.get_text_config().max_position_embeddings - 1  # kv-embedding's prefix takes one
        if (longest := batch["input_ids"].shape[1]) > limit:
            raise KVMemError(f"text too long to embed: {longest} tokens with the {self.name} prompt, the model's "
                             f"context allows {limit}; split it into chunks")
        hidden = self._hidden_states(batch)
        return [self._pool(hidden[layer].float(), batch["attention_mask"], batch, texts) for layer in layers]

    def _embed(self, texts: list[str]) -> Tensor:
        return self._forward(texts, [self.layer])[0]

    @torch.no_grad()
    def encode_layers(self, texts: Sequence[str], layers: Sequence[int], batch_size: int = 8) -> dict[int, np.ndarray]:
        """float32 embeddings at several layers from one forward pass per batch: {layer: (n, dim)}."""
        for layer in layers:
            if not 0 <= layer <= self.n_layers:
                raise KVMemError(f"layer {layer} out of range for a model with {self.n_layers} layers")
        texts = list(texts)
        out: dict[int, list[Tensor]] = {layer: [] for layer in layers}
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        for i in range(0, len(order), batch_size):
            for layer, emb in zip(layers, self._forward([texts[j] for j in order[i:i + batch_size]], layers)):
                out[layer].append(emb)
        inverse = np.argsort(order)
        return {layer: torch.cat(embs).numpy()[inverse] for layer, embs in out.items()}

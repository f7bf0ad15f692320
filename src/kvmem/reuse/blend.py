"""Non-prefix KV reuse for RAG: precomputed documents assembled at new positions, cross-chunk attention repaired.

Each document's KV is precomputed once (`precompute`), on its own after the shared template head (system
prompt, start of the user turn): as in CacheBlend, every chunk is computed independently, and the head is a
true prefix (reused exactly, and no chunk starts cold as an attention sink). `assemble_and_answer` places the
documents one after another after the head, re-rotates each cached key to its new position
(`kvmem.rope.move`) and answers the question, whose tokens are always computed in full, with one of:

* `none`: the assembled KV as it is; documents never attend to each other (the baseline).
* `full`: a full prefill of documents and question after the head (the quality reference).
* `cacheblend`: Yao et al., EuroSys 2025, "CacheBlend: Fast Large Language Model Serving for RAG with Cached
  Knowledge Fusion". Selective KV recompute: the layers before `check_layer` recompute every token; at
  `check_layer` every token's K/V is computed and the `recompute_ratio` of document tokens whose fresh values
  deviate most from the cached ones (squared L2 over heads and channels: the high-KV-deviation tokens) keep
  their fresh K/V, the others keep the cached rows. From there on only the selected tokens and the question go
  through the layers, their fresh K/V replacing the cached rows while they attend, causally by position, to
  every row (cached and refreshed). The set is fixed at the check layer (no further gradual filtering).
* `infoflow`: the seed paper "selective KV recomputation as an information flow problem" (RAG; only its
  abstract is at hand). Tokens are chosen by the question's attention norm computed under the global RoPE
  positions the chunks have at inference, and chunks are reordered by that flow. Details the abstract leaves
  open, chosen here: a document token j scores, per layer, sum over question tokens i and query heads h of
  ||a_hij W_O,h v_j|| (norm-based attention, Kobayashi et al. 2020), normalised over the document tokens and
  averaged over layers, read while the question is fed on the assembled, unrepaired KV. Chunks are then sorted
  by their summed score, ascending: the chunk the question draws most from sits next to it, and its recomputed
  tokens see every other chunk. The scores are read again at the new positions, and the top `recompute_ratio`
  of document tokens are recomputed in every layer (with the question); the rest is reused.

Compute is counted in token-layers (one token through one decoder layer, its K/V computed). The head is a
prefix-cache hit for every method and is not counted: `full` computes L x (document + question tokens);
infoflow's scoring passes (L x question tokens each) are counted in its total.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvmem.attention import visible
from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.forward import feed
from kvmem.generate import decode
from kvmem.models import LoadedModel
from kvmem.reuse.recompute import KV, DeviationChoice, empty_kv, run_layers, text_config, to_cache
from kvmem.rope import move, rope_frequencies
from kvmem.rows import ExportedRows

METHODS = ("none", "full", "cacheblend", "infoflow")


@dataclass
class DocKV:
    """One document's precomputed KV: per layer its rows (`positions` len(head) + range(len(tokens))), plain
    tensors as `KVLayer.export_rows` gives them (what the chunk store keeps), the tokens and the head it follows."""

    tokens: list[int]
    head: list[int]
    layers: list[ExportedRows]
    fingerprint: str

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class BlendResult:
    method: str
    text: str
    tokens: list[int]  # the answer
    cache: KVCache  # head + documents + question (+ the answer's tokens but the last), ready to decode on
    logits: Tensor  # of the first answer token
    token_layers: int  # computed for documents and question, scoring passes included
    full_token_layers: int  # what a full prefill of documents and question computes
    layer_tokens: list[int]  # tokens computed per layer in the answering pass
    selected: Tensor  # prompt positions of the recomputed document tokens
    order: list[int]  # the documents' indices in the order they were placed
    spans: list[range] = field(default_factory=list)  # prompt positions of each placed document
    seconds: float = 0.0

    @property
    def compute_fraction(self) -> float:
        return self.token_layers / self.full_token_layers


@torch.no_grad()
def precompute(lm: LoadedModel, doc_ids: list[int], head_ids: list[int] = ()) -> DocKV:
    """A document's KV computed on its own after `head_ids` (the shared template head): every layer's rows,
    sliding layers included whole (a chunk placed elsewhere needs rows its own last token no longer sees)."""
    doc, head = list(doc_ids), list(head_ids)
    if not doc:
        raise KVMemError("precompute: the document has no tokens")
    if len(head) + len(doc) > lm.max_context:
        raise KVMemError(f"precompute: context too long: {len(head) + len(doc)} tokens > {lm.max_context} that "
                         f"{lm.name} allows")
    n, device = len(head) + len(doc), lm.model.device
    kv, positions = empty_kv(lm, n), torch.arange(n, device=device)
    run_layers(lm, kv, positions, torch.tensor(head + doc, device=device), positions)
    layers = [ExportedRows([{"keys": k[h, len(head):].clone(), "values": v[h, len(head):].clone(),
                             "positions": positions[len(head):].to(torch.int32)} for h in range(k.shape[0])])
              for k, v in kv]
    return DocKV(doc, head, layers, lm.fingerprint)


DOCUMENT = "document"  # the store namespace of documents precomputed on their own after a head


def document_key(store, lm: LoadedModel, doc_ids: list[int], head_ids: list[int] = ()) -> str:
    return store.span_key(lm, list(head_ids) + [-1] + list(doc_ids), DOCUMENT)  # -1: no token, marks where the head ends


def store_document(store, lm: LoadedModel, doc: DocKV) -> bool:
    """Keep a precomputed document in a `kvmem.store.ChunkStore` (its rows as they are, verified on read)."""
    return store.save(lm, document_key(store, lm, doc.tokens, doc.head), doc.layers, len(doc.head), len(doc), DOCUMENT)


def load_document(store, lm: LoadedModel, doc_ids: list[int], head_ids: list[int] = ()) -> DocKV | None:
    """The document as stored by `store_document` (every check of `ChunkStore.load` passed), or None."""
    got = store.load(lm, document_key(store, lm, doc_ids, head_ids), len(head_ids), len(doc_ids), DOCUMENT)
    if got is None or any(h["positions"].numel() != len(doc_ids) for rows in got.layers for h in rows.heads):
        return None  # a document keeps every row, sliding layers included
    return DocKV(list(doc_ids), list(head_ids), got.layers, lm.fingerprint)


def precomputed(store, lm: LoadedModel, doc_ids: list[int], head_ids: list[int] = ()) -> DocKV:
    """The stored document, or computed now and stored."""
    doc = load_document(store, lm, doc_ids, head_ids) if store is not None else None
    if doc is None:
        doc = precompute(lm, doc_ids, head_ids)
        if store is not None:
            store_document(store, lm, doc)
    return doc


def _spans(n_head: int, docs: list[DocKV], order: list[int]) -> list[range]:
    starts = [n_head + sum(len(docs[j]) for j in order[:x]) for x in range(len(order))]
    return [range(a, a + len(docs[i])) for a, i in zip(starts, order)]


def _assemble(lm: LoadedModel, head: list[int], head_kv: KV, docs: list[DocKV], order: list[int], question: list[int]):
    """Slot K/V of head + documents in `order` (keys moved to their new positions) + question (empty slots)."""
    n, device = len(head) + sum(len(d) for d in docs) + len(question), lm.model.device
    kv, positions, spans = empty_kv(lm, n), torch.arange(n, device=device), _spans(len(head), docs, order)
    for layer, (keys, values) in enumerate(kv):
        keys[:, :len(head)], values[:, :len(head)] = head_kv[layer]
        freq = rope_frequencies(lm.model, layer)
        for i, span in zip(order, spans):
            rows = docs[i].layers[layer].heads
            k, v = torch.stack([r["keys"] for r in rows]), torch.stack([r["values"] for r in rows])
            keys[:, span.start:span.stop] = move(k, rows[0]["positions"], positions[span.start:span.stop], freq)
            values[:, span.start:span.stop] = v
    ids = head + [t for i in order for t in docs[i].tokens] + question
    return kv, positions, torch.tensor(ids, device=device), spans


def _flow_scores(lm: LoadedModel, head: list[int], head_kv: KV, docs: list[DocKV], order: list[int],
                 question: list[int]) -> Tensor:
    """infoflow's score of each placed document token: the question's attention norm (see the module doc)."""
    kv, positions, ids, spans = _assemble(lm, head, head_kv, docs, order, question)
    doc_slots = torch.arange(spans[0].start, spans[-1].stop, device=positions.device)
    q_slots = torch.arange(spans[-1].stop, positions.numel(), device=positions.device)
    _, _, queries = run_layers(lm, kv, positions, ids, q_slots, observe=True)
    total = torch.zeros(doc_slots.numel(), device=positions.device)
    for layer, ((query, scaling), (keys, values)) in enumerate(zip(queries, kv)):
        attn = lm.model.model.layers[layer].self_attn
        hq, hkv = query.shape[0], keys.shape[0]
        logits = torch.matmul(query, keys.repeat_interleave(hq // hkv, 0).transpose(1, 2)) * scaling  # (Hq, Q, N)
        seen = visible(positions[None], positions[q_slots], getattr(attn, "sliding_window", None))
        weights = logits.masked_fill(~seen, float("-inf")).softmax(-1).sum(1)  # (Hq, N)
        w_o = attn.o_proj.weight.reshape(attn.o_proj.weight.shape[0], hq, -1).transpose(0, 1)  # (Hq, hidden, D)
        v = values.repeat_interleave(hq // hkv, 0)
        norms = (torch.matmul(v, w_o.transpose(1, 2) @ w_o) * v).sum(-1).clamp_min(0).sqrt()  # ||W_O,h v_j|| (Hq, N)
        flow = (weights * norms).sum(0)[doc_slots]
        total += flow / flow.sum().clamp_min(1e-12)
    return total / len(queries)


def _check(lm: LoadedModel, head: list[int], docs: list[DocKV], question: list[int], method: str, ratio: float,
           max_new_tokens: int, check_layer: int) -> None:
    if method not in METHODS:
        raise KVMemError(f"unknown reuse method {method!r}; choose from {', '.join(METHODS)}")
    if not 0.0 <= ratio <= 1.0:
        raise KVMemError(f"recompute ratio must be in [0, 1]; got {ratio}")
    if not docs or any(len(d) == 0 for d in docs):
        raise KVMemError("assemble_and_answer needs at least one document, each with tokens")
    if not question:
        raise KVMemError("the question has no tokens")
    n_layers = text_config(lm).num_hidden_layers
    for i, d in enumerate(docs):
        if d.head != head:
            raise KVMemError(f"document {i} was precomputed after another head ({len(d.head)} tokens), not this one")
        if d.fingerprint != lm.fingerprint or len(d.layers) != n_layers:
            raise KVMemError(f"document {i} was precomputed by another model ({d.fingerprint}, {len(d.layers)} layers)")
    if not 0 <= check_layer < n_layers:
        raise KVMemError(f"check_layer must be in [0, {n_layers}); got {check_layer}")
    n = len(head) + sum(len(d) for d in docs) + len(question) + max_new_tokens
    if n > lm.max_context:
        raise KVMemError(f"context too long: {n} tokens (prompt + {max_new_tokens} to answer) > {lm.max_context} "
                         f"that {lm.name} allows")


@torch.no_grad()
def assemble_and_answer(lm: LoadedModel, head_ids: list[int], docs: list[DocKV], question_ids: list[int],
                        method: str = "cacheblend", recompute_ratio: float = 0.15, max_new_tokens: int = 32,
                        check_layer: int = 1, reorder: bool = True, stop_at_newline: bool = True,
                        answers=()) -> BlendResult:
    """Answer `question_ids` after `head_ids` and the precomputed `docs` (see the module doc for the methods).
    `reorder=False` keeps infoflow from reordering the chunks (an ablation). `max_new_tokens=0` only prefills
    (the result's `logits` and `cache`). `answers` may stop decoding early (once all are in the answer)."""
    head, question = list(head_ids), list(question_ids)
    _check(lm, head, docs, question, method, recompute_ratio, max_new_tokens, check_layer)
    t0, n_layers, device = time.perf_counter(), text_config(lm).num_hidden_layers, lm.model.device
    n_docs, order, scoring = sum(len(d) for d in docs), list(range(len(docs))), 0
    if method == "full":
        cache = KVCache(lm.model.config)
        if head:
            feed(lm, cache, head)
        logits = feed(lm, cache, [t for d in docs for t in d.tokens] + question)
        spans = _spans(len(head), docs, order)
        selected, counts = torch.arange(len(head), len(head) + n_docs), [n_docs + len(question)] * n_layers
    else:
        head_kv = empty_kv(lm, len(head))
        if head:
            run_layers(lm, head_kv, torch.arange(len(head), device=device), torch.tensor(head, device=device),
                 torch.arange(len(head), device=device))
        if method == "infoflow":
            scores, scoring = _flow_scores(lm, head, head_kv, docs, order, question), n_layers * len(question)
            chunk = [float(scores[r.start:r.stop].sum()) for r in _spans(0, docs, order)]  # per chunk, in order
            order = sorted(order, key=lambda i: chunk[i]) if reorder else order  # the most drawn-on chunk last
            if order != list(range(len(docs))):  # read again under the positions the answer will use
                scores, scoring = _flow_scores(lm, head, head_kv, docs, order, question), 2 * n_layers * len(question)
        kv, positions, ids, spans = _assemble(lm, head, head_kv, docs, order, question)
        doc_slots = torch.arange(len(head), len(head) + n_docs, device=device)
        q_slots = torch.arange(len(head) + n_docs, positions.numel(), device=device)
        k = round(recompute_ratio * n_docs)
        if method == "none":
            selected = doc_slots[:0]
            logits, counts, _ = run_layers(lm, kv, positions, ids, q_slots)
        elif method == "cacheblend":
            active = torch.cat([doc_slots, q_slots])
            choose = DeviationChoice(active < len(head) + n_docs, k)  # the question is always computed
            logits, counts, _ = run_layers(lm, kv, positions, ids, active, check_layer, choose)
            selected = active[choose.picked].sort().values
        else:
            selected = doc_slots[scores.topk(k).indices].sort().values
            logits, counts, _ = run_layers(lm, kv, positions, ids, torch.cat([selected, q_slots]))
        cache = to_cache(lm, kv, positions)
    tokens = decode(lm, cache, logits, max_new_tokens, stop_at_newline, answers) if max_new_tokens > 0 else []
    return BlendResult(method, lm.tokenizer.decode(tokens) if tokens else "", tokens, cache, logits,
                       sum(counts) + scoring, n_layers * (n_docs + len(question)), counts, selected.cpu(), order, spans,
                       time.perf_counter() - t0)

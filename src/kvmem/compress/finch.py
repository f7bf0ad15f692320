"""`finch`: the document read chunk by chunk, each chunk followed by the prompt, keeping what the prompt attends to.

Corallo and Papotti 2024, "FINCH: Prompt-guided Key-Value Cache Compression" (TACL 2024, arXiv 2408.00167; reference
code github.com/giulio98/context-compression, `LlamaForCompressedCausalLM.generate`, mode `attention_score`). The
document is split into chunks of `chunk` tokens (the reference's `split_size`, 512 in its LongBench configs). Each
chunk is fed on the cache compressed so far, followed by the prompt (the question); in every layer the prompt's
queries score the cached rows and the chunk's: a row's score is the softmax attention each prompt query gives it,
times (keys that query sees / keys in the layer) (`normalize`, on by default: the weights the reference computes
and kvpress's FinchPress applies; they weigh later prompt tokens more), summed over the prompt's queries and over
every query head of the layer, so the layer's heads keep the same rows (the reference sums `layer_attention` over heads and gathers one index set for all). The layer keeps its top rows
among the compressed past and the chunk, and the prompt's rows are dropped before the next chunk. After chunk c the
layer holds ceil(D x (document read) / (document length)) document rows, D its final budget (the reference's
`k = seg_len // compression_factor + past_cache_len`, the share of every chunk added to what is kept). So the rows
kept are computed as in Finch: each chunk's keys and values attend only to what earlier steps kept.

In kvmem a cache is compressed after it was prefilled, so the procedure runs on a fresh cache, its final rows replace
the prefilled ones at the positions it kept (same positions, Finch's keys and values), and `compress` evicts the rest:
the memory is freed as for every method, but the prefill held the whole document first (Finch never does).

The prompt: in the query-aware setting, the question the cache holds after the context (`ModelContext.question`, the ids
`kvmem.generate` and the benchmark pass); it is kept, with the rows the last step computed for it (the reference
feeds the question again over the compressed cache to answer). With no question (query-agnostic), the last `window`
tokens of the context stand in for it: they are kept, the document before them is compressed. The chat template's
head (`ModelContext.head`) is fed first and always kept (the reference's context has no template: its system prompt
comes with the question, after compression).

Normalisation: the released reference code computes the weighted attention and then overwrites it with the unweighted
one (`context_attention = summed_attention[...]` right after the `if self.normalize:` block), so its runs scored
without it; `normalize=false` gives that.

Departures: positions. The reference re-rotates the kept keys to consecutive positions after every step and feeds
the next chunk right after them; kvmem keeps original positions (its cache's convention; kvpress's FinchPress has
the same switch, `rerotate_keys`), so each chunk is fed at its own positions and the prompt right after the chunk.
Budget: the keep ratio of each layer (`compress`'s), over the rows the layer holds before the question; only
`budget=uniform` (the procedure fixes its budgets as it runs). Sliding-window layers (not in the reference) score and
keep the rows their window holds. The single-pass variant of kvpress's FinchPress (the question's attention from the
one prefill, normalised) is not this method. Needs the model: compress, then generate (not `Compressor`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.compress.base import HeadView, Method, ModelContext, causal_logits
from kvmem.errors import KVMemError
from kvmem.forward import feed


class Finch(Method):
    name = "finch"
    needs_model = True
    budgets = ("uniform",)  # the procedure fixes each layer's budget as it reads the chunks

    def __init__(self, chunk: int = 512, window: int = 32, normalize: bool = True):
        if chunk < 1:
            raise KVMemError(f"finch needs chunk >= 1 tokens per chunk; got chunk={chunk}")
        if window < 1:
            raise KVMemError(f"finch needs window >= 1 (the prompt's length where there is no question); got window={window}")
        self.chunk, self.window, self.normalize = chunk, window, normalize

    def score_cache(self, views: dict[int, list[HeadView]], cache: KVCache, context: ModelContext) -> dict[int, list[Tensor]]:
        if self.budget != "uniform":
            raise KVMemError(f"finch fixes each layer's budget as it reads the chunks: budget={self.budget!r} cannot "
                             "apply; use budget=uniform")
        ids, tail = list(context.ids), list(context.question)
        if not ids or len(ids) + len(tail) != cache.get_seq_length():
            raise KVMemError(f"finch reruns what the cache holds: context.ids ({len(ids)}) + context.question ({len(tail)}, "
                             f"the question) must be the {cache.get_seq_length()} tokens it holds from position 0")
        if any(layer.quant is not None or hasattr(layer.rows, "demote") for layer in cache.layers if layer.is_initialized):
            raise KVMemError("finch replaces the kept rows by the ones its chunked prefill computed; this cache holds "
                             "quantized rows: compress a full-precision cache, then quantize it")
        if any(layer.evicted() for layer in cache.layers if layer.is_initialized and not layer.is_sliding):
            raise KVMemError("finch compresses an uncompressed cache (it re-reads the whole document)")
        ratios = context.keep_ratios or [1.0] * len(cache.layers)
        key = ("finch", self.chunk, self.window, self.normalize, tuple(ratios), len(ids), tuple(tail))
        if key not in context.memo:
            context.memo[key] = self.run(context, cache, ratios)
        rows, scores = context.memo[key]
        for i, layer in enumerate(cache.layers):
            if layer.is_initialized and rows[i] is not None:
                _transplant(layer, rows[i])
        return {i: [scores[i][view.positions.long()] for view in heads] for i, heads in views.items()}

    def spans(self, context: ModelContext) -> tuple[list[int], int, int]:
        """The prompt, and where the document starts and ends (positions)."""
        ids, tail = list(context.ids), list(context.question)
        prompt = tail if tail else ids[max(min(context.head, len(ids)), len(ids) - self.window):]
        end = len(ids) if tail else len(ids) - len(prompt)
        return prompt, min(context.head, end), end

    @torch.no_grad()
    def run(self, context: ModelContext, target: KVCache, ratios: list[float]) -> tuple[list, list[Tensor]]:
        """Finch's chunked prefill on a fresh cache. Per layer: its final rows per head (keys, values, positions), and
        a score per position: +inf for the head and the prompt, the last score of each document row, raised above
        every evicted row for the rows kept."""
        lm, ids = context.lm, list(context.ids) + list(context.question)
        prompt, start, end = self.spans(context)
        n_all = len(ids)
        scores = [torch.full((n_all,), float("inf")) for _ in target.layers]
        if end <= start:  # no document before the prompt: nothing to choose, everything is the head or the prompt
            return [None] * len(target.layers), scores
        budgets = []
        for i, layer in enumerate(target.layers):  # the document rows each layer keeps at the end
            held = layer.head_positions[0]
            compressible = held[held < len(context.ids)]
            doc = int(((compressible >= start) & (compressible < end)).sum())
            share = max(1, math.ceil(ratios[i] * compressible.numel()))
            budgets.append(min(doc, max(0, share - (compressible.numel() - doc))))
        work = KVCache(lm.model.config, observe_window=len(prompt))
        if start:
            feed(lm, work, ids[:start])
        for c0 in range(start, end, self.chunk):
            c1 = min(c0 + self.chunk, end)
            self._step(lm, work, ids[c0:c1] + prompt, start, end, c1, budgets, scores)
        rows = [list(layer.rows.heads()) for layer in work.layers]
        for i, layer in enumerate(work.layers):
            kept = layer.head_positions[0].long()
            doc = kept[(kept >= start) & (kept < end)]
            s = scores[i]
            top = s[start:end][torch.isfinite(s[start:end])].max() if doc.numel() else s.new_zeros(())
            s[doc] = s[doc] + top + 1  # the rows Finch kept rank above every row it evicted
        return rows, scores

    def _step(self, lm, work: KVCache, ids: list[int], start: int, end: int, c1: int, budgets: list[int],
              scores: list[Tensor]) -> None:
        """Feed one chunk and the prompt; each layer, right after its attention, keeps its top rows."""
        n_prompt, last = work.layers[0].observation.window, c1 == end  # the work cache observes the prompt's queries

        def hook(layer, idx: int) -> None:
            keys, _, positions, new_pos = layer.seen
            q, qp = layer.observation.recent_queries[:, -n_prompt:], new_pos[-n_prompt:]
            g = q.shape[0] // len(keys)
            total = torch.zeros(int(qp.max()) + 1)
            for h, (k, p) in enumerate(zip(keys, positions)):
                logits = causal_logits(q[h * g:(h + 1) * g], k, p, qp, layer.observation.scaling)
                if layer.sliding_window is not None:
                    logits.masked_fill_(p[None, None, :] <= qp[None, :, None] - layer.sliding_window, float("-inf"))
                seen = torch.isfinite(logits[0]).sum(dim=-1)  # keys each prompt query sees
                attn = logits.softmax(dim=-1)
                if self.normalize:  # later prompt queries see more keys, so their attention is spread thinner
                    attn = attn * (seen.float() / k.shape[0])[None, :, None]
                total.index_add_(0, p.long(), attn.sum(dim=(0, 1)))
            held = layer.head_positions[0].long()
            cand = ((held >= start) & (held < c1)).nonzero().flatten()
            s = total[held[cand]]
            scores[idx][held[cand]] = s
            n_keep = min(cand.numel(), math.ceil(budgets[idx] * (c1 - start) / (end - start)))
            chosen = cand[s.topk(n_keep).indices]
            keep = torch.cat([(held < start).nonzero().flatten(), chosen] + ([(held >= c1).nonzero().flatten()] if last
                                                                            else []))
            layer.keep_only([keep] * layer.num_heads)
            if not last:  # the prompt's rows are gone: the next chunk continues right after this one
                layer.next_position = c1

        for layer in work.layers:
            layer.compressor = hook
        try:
            feed(lm, work, ids)
        finally:
            for layer in work.layers:
                layer.compressor = None


def _transplant(layer, rows: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    """Put Finch's rows in place of the layer's rows at the same positions (same number of rows: the observation and
    the views stay aligned; `compress` then evicts the rest)."""
    ks, vs, ps = [], [], []
    for (k, v, p), (kw, vw, pw) in zip(layer.rows.heads(), rows):
        k, v = k.clone(), v.clone()
        at = torch.searchsorted(p, pw).clamp(max=max(p.numel() - 1, 0))
        ok = p[at] == pw if p.numel() else torch.zeros_like(pw, dtype=torch.bool)
        k[at[ok]], v[at[ok]] = kw[ok].to(k.dtype), vw[ok].to(v.dtype)
        ks.append(k)
        vs.append(v)
        ps.append(p)
    layer.rows = layer.rows.with_rows(ks, vs, ps)

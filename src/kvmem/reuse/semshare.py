"""SemShareKV: reuse the KV of a semantically similar (not token-identical) prompt, aligned token by token, with the
tokens that matter recomputed.

Zhao & Mastorakis 2025, "SemShareKV: Efficient KVCache Sharing for Semantically Similar Prompts via Token-Level LSH
Matching" (arXiv 2509.24832; its abstract is what kvmem follows): instead of exact token matches, fuzzy token matching
by locality-sensitive hashing (LSH) on token embeddings, with Rotary Position Embedding (RoPE) to keep positional
information; the relevant KV pairs of a reference prompt's cache are reused, the rest recomputed.

    index = SemanticIndex(store)                              # the remembered prompts (semantic_index.py)
    cache, logits, report = prefill_semshare(lm, ids, index, always_from=len(prompt.context))
    report.summary()                                          # reference, matched / recomputed tokens, compute share

Per prompt (the target):

1. **Reference**: the remembered prompts the embedding proposes (`SemanticIndex.candidates`, k nearest); the most
   similar one whose pieces (chunks and tail) all load, verified by the store, and hold every row of every layer is the
   reference. A candidate with a missing piece is dropped from the index. With no reference the prompt is prefilled
   exactly as token recycling does (`prefill_semantic`: exact chunk reuse, then remembered), and `report.path` says so.
2. **Exact prefix**: the tokens the target shares with the reference from the start are the reference's rows, as they
   are (an exact prefix's KV does not depend on what follows) and are never recomputed.
3. **Fuzzy matching** of the other context tokens (`match_tokens`): each token's input embedding, read as head-sized
   blocks each rotated by RoPE at the token's position (the first layer's frequencies; ours: the abstract says RoPE is
   used, not how), is hashed by random-hyperplane LSH (`tables` tables of `bits` sign bits, seeded); a target token's
   candidates are the reference tokens sharing a bucket with it in any table, and it takes the one of highest cosine,
   if at least `min_similarity`. The same token nearby scores highest, the same token far away less, another token
   little: a reordered or reworded document keeps most of its tokens matched.
4. **Placement**: a matched token gets its reference token's key and value, the key re-rotated from the reference
   position to its own (`kvmem.rope.move`).
5. **Selective recompute** (CacheBlend's machinery, `kvmem.reuse.recompute`, which `blend.py` runs too): every token after the exact prefix goes
   through the layers before `check_layer`; there, of the matched tokens, the `recompute_ratio` whose fresh values
   deviate most from the placed ones go on through every later layer with the unmatched tokens and the question
   (from `always_from` on, always computed); the others keep the placed rows. The paper's observation that
   high-deviation tokens stay the same across layers is what lets the set be fixed at the check layer.

Not done here (the abstract's "compression" half): the paper also keeps fewer tokens in deeper layers to save memory;
kvmem's compression methods are separate (`reuse=prefix` with a method), and a semshare cache holds every row. The
prefill is not interrupted between pieces (as cacheblend's); the KV it builds is approximate, so it is never stored
under the prompt's exact chunk keys, and the prompt is not remembered as a reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.reuse.recompute import DeviationChoice, empty_kv, run_layers, to_cache
from kvmem.reuse.semantic import SemanticReport, _entry_pieces, prefill_semantic
from kvmem.reuse.semantic_index import Match, SemanticIndex, check_ids
from kvmem.rope import move, rope_frequencies, rotate
from kvmem.store.store import ChunkStore


@dataclass
class SemShareReport(SemanticReport):
    """A `SemanticReport` (path "semshare" when a reference was used; else the exact path taken) with what the
    alignment found and what was recomputed. `reused_tokens`: prompt tokens whose rows are the reference's, not
    recomputed (the exact prefix and the matched tokens kept)."""

    reference_tokens: int = 0  # the reference prompt's length
    exact_tokens: int = 0  # the common token prefix with the reference (reused as is)
    matched_tokens: int = 0  # context tokens after it aligned to a reference token
    recomputed_tokens: int = 0  # of those, recomputed through every layer
    match_s: float = 0.0  # the LSH alignment and the placement of the reference's rows
    token_layers: int = 0  # tokens computed through one decoder layer, summed over layers
    full_token_layers: int = 0  # what a cold prefill computes

    @property
    def compute_fraction(self) -> float:
        return self.token_layers / self.full_token_layers if self.full_token_layers else 1.0

    def summary(self) -> str:
        if self.path != "semshare":
            return "[semshare: no reference; exact reuse] " + super().summary()
        return (f"[semshare: reference of {self.reference_tokens} tokens (similarity {self.match_score:.2f}): "
                f"{self.exact_tokens} exact, {self.matched_tokens} matched, {self.recomputed_tokens} of them recomputed; "
                f"{self.compute_fraction:.0%} of a cold prefill's token-layers; lookup {self.lookup_s:.3f} s, load "
                f"{self.load_s:.3f} s, match {self.match_s:.3f} s, prefill {self.prefill_s:.2f} s] reused "
                f"{self.reused_tokens} of {self.prompt_tokens} prompt tokens")


def position_embeddings(lm, ids: list[int]) -> Tensor:
    """The tokens' input embeddings with RoPE at their positions (T, padded hidden), unit length: the hidden vector
    read as head-sized blocks (zero-padded), each rotated as a key at the token's position with layer 0's frequencies."""
    model = lm.model
    emb = model.model.embed_tokens(torch.tensor([ids], device=model.device))[0].float()
    freq = rope_frequencies(model, 0)
    dim = 2 * freq.numel()
    pad = (-emb.shape[1]) % dim
    blocks = torch.nn.functional.pad(emb, (0, pad)).reshape(len(ids), -1, dim).transpose(0, 1)  # (blocks, T, dim)
    rotated = rotate(blocks, torch.arange(len(ids), device=emb.device), freq).transpose(0, 1).reshape(len(ids), -1)
    return torch.nn.functional.normalize(rotated, dim=-1)


def match_tokens(target: Tensor, reference: Tensor, bits: int = 8, tables: int = 8, min_similarity: float = 0.5,
                 seed: int = 0, block: int = 1024) -> tuple[Tensor, Tensor]:
    """LSH fuzzy matching: for each target vector (unit rows), the reference row of highest cosine among those sharing
    an LSH bucket with it in any of `tables` random-hyperplane tables of `bits` bits. Returns (reference index per
    target row, -1 when none, and the cosine of the match)."""
    if not 1 <= bits <= 62 or tables < 1:
        raise KVMemError(f"LSH needs 1..62 bits and at least one table, got bits={bits}, tables={tables}")
    g = torch.Generator().manual_seed(seed)
    planes = torch.randn(tables * bits, target.shape[1], generator=g).to(target)
    weights = (2 ** torch.arange(bits, dtype=torch.int64, device=target.device))

    def codes(x: Tensor) -> Tensor:  # (T, tables) bucket ids
        return ((x @ planes.T > 0).reshape(len(x), tables, bits).long() * weights).sum(-1)

    ref_codes = codes(reference)
    best, score = torch.full((len(target),), -1, dtype=torch.long), torch.full((len(target),), float("-inf"))
    for a in range(0, len(target), block):  # (block x reference) at a time
        t = target[a:a + block]
        same = (codes(t)[:, None, :] == ref_codes[None, :, :]).any(-1)
        sims = (t @ reference.T).masked_fill(~same, float("-inf"))
        s, j = sims.max(-1) if sims.shape[1] else (torch.full((len(t),), float("-inf")), torch.zeros(len(t), dtype=torch.long))
        ok = s >= min_similarity
        best[a:a + block] = torch.where(ok, j, torch.full_like(j, -1))
        score[a:a + block] = s
    return best, score


def _reference_rows(lm, store: ChunkStore, index: SemanticIndex, match: Match, report: SemShareReport):
    """Every layer's keys and values (KV heads, L, head_dim) of a remembered prompt, from its verified pieces; None if a
    piece is missing (the entry is dropped from the index) or a layer lacks a row (a sliding window shorter than a
    chunk)."""
    pieces, reach = _entry_pieces(store, lm, match, 0, len(match.ids), set(), index)
    if reach < len(match.ids):
        return None
    want = torch.arange(len(match.ids), dtype=torch.int32)
    layers = []
    for l in range(len(pieces[0].layers)):
        heads = [[p.layers[l].heads[h] for p in pieces] for h in range(len(pieces[0].layers[l].heads))]
        if any(not torch.equal(torch.cat([part["positions"] for part in parts]), want) for parts in heads):
            return None
        layers.append((torch.stack([torch.cat([part["keys"] for part in parts]) for parts in heads]),
                       torch.stack([torch.cat([part["values"] for part in parts]) for parts in heads])))
    for p in pieces:
        report.tiers[p.tier] += 1
        report.bytes_read += p.nbytes
        report.read_s += p.read_s
        report.decode_s += p.decode_s
    report.chunks_loaded = len(pieces)
    return layers


@torch.no_grad()
def prefill_semshare(lm, ids: list[int], index: SemanticIndex, recompute_ratio: float = 0.15,
                     always_from: int | None = None, k: int = 4, check_layer: int = 1, bits: int = 8, tables: int = 8,
                     min_similarity: float = 0.5, text: str | None = None, remember: bool = True,
                     store: ChunkStore | None = None, interrupt=None) -> tuple[KVCache, Tensor, SemShareReport]:
    """Prefill `ids` reusing a semantically similar remembered prompt's KV (see the module doc). Tokens from
    `always_from` on (the question; default: the last token) are always computed. Returns a new plain cache holding the
    prompt, the last token's logits and a `SemShareReport`. With no usable reference: `prefill_semantic` (exact reuse;
    the prompt is remembered when `remember`). `store`: a policy view of the index's store (the server's `use_store` /
    `fill_store`); `interrupt()` is called before the prefill."""
    ids = check_ids(lm, ids)
    n_layers = lm.model.config.get_text_config().num_hidden_layers
    if not 0.0 <= recompute_ratio <= 1.0:
        raise KVMemError(f"recompute ratio must be in [0, 1]; got {recompute_ratio}")
    if not 0 <= check_layer < n_layers:
        raise KVMemError(f"check_layer must be in [0, {n_layers}); got {check_layer}")
    always_from = len(ids) - 1 if always_from is None else always_from
    if not 0 <= always_from < len(ids):
        raise KVMemError(f"always_from {always_from} is outside the {len(ids)} tokens (the last one is always computed)")
    store = index.store if store is None else store
    report = SemShareReport(prompt_tokens=len(ids), full_token_layers=n_layers * len(ids))
    t = time.perf_counter()
    vector = index.embed(lm, ids, text)
    found = index.candidates(lm, ids, k, vector=vector) if vector is not None and store.reads else []
    report.candidates = len(found)
    reference = None
    for match in sorted(found, key=lambda m: (-m.score, -m.common)):  # the most similar prompt that loads whole
        reference = _reference_rows(lm, store, index, match, report)
        if reference is not None:
            break
    report.lookup_s = time.perf_counter() - t - report.read_s - report.decode_s
    if reference is None:  # nothing to share: the exact path, which remembers the prompt as a future reference
        cache = KVCache(lm.model.config)
        logits, exact = prefill_semantic(lm, cache, ids, index, min_tail=len(ids) - always_from, k=k, text=text,
                                         remember=remember, store=store, interrupt=interrupt, vector=vector)
        for f in SemanticReport.__dataclass_fields__:
            setattr(report, f, getattr(exact, f))
        report.token_layers = n_layers * report.computed_tokens
        return cache, logits, report
    index.used(match.ids)
    if interrupt is not None:
        interrupt()
    t = time.perf_counter()
    ref_ids = match.ids.tolist()
    exact = min(match.common, always_from)
    if always_from > exact:  # position_embeddings of the whole prompt, so that each token is rotated at its position
        matched, _ = match_tokens(position_embeddings(lm, ids)[exact:always_from], position_embeddings(lm, ref_ids),
                                  bits, tables, min_similarity)
    else:
        matched = torch.zeros(0, dtype=torch.long)
    n, device = len(ids), lm.model.device
    kv, positions = empty_kv(lm, n), torch.arange(n, device=device)
    targets = exact + (matched >= 0).nonzero().flatten()  # target positions with a match
    sources = matched[matched >= 0]  # their reference positions
    for layer, ((keys, values), (ref_k, ref_v)) in enumerate(zip(kv, reference)):
        keys[:, :exact], values[:, :exact] = ref_k[:, :exact], ref_v[:, :exact]
        keys[:, targets] = move(ref_k[:, sources], sources, targets, rope_frequencies(lm.model, layer)).to(keys.dtype)
        values[:, targets] = ref_v[:, sources].to(values.dtype)
    report.match_s = time.perf_counter() - t
    active = torch.arange(exact, n, device=device)
    candidates = torch.zeros(n - exact, dtype=torch.bool, device=device)
    candidates[targets - exact] = True
    recompute = round(recompute_ratio * len(targets))
    t = time.perf_counter()
    choose = DeviationChoice(candidates, recompute)
    logits, counts, _ = run_layers(lm, kv, positions, torch.tensor(ids, device=device), active, check_layer, choose)
    cache = to_cache(lm, kv, positions)
    report.prefill_s = time.perf_counter() - t
    report.path, report.match_key, report.match_score = "semshare", match.key, match.score
    report.reference_tokens, report.exact_tokens, report.candidate_tokens = len(ref_ids), exact, match.common
    report.matched_tokens, report.recomputed_tokens = len(targets), recompute
    report.reused_tokens = exact + len(targets) - recompute
    report.computed_tokens = n - report.reused_tokens
    report.token_layers = sum(counts)
    return cache, logits, report

"""Semantic lookup with verification: find remembered prompts by sentence embedding, reuse the stored KV of the
longest common *token* prefix, prefill the rest.

The seed paper, "token recycling" (abstract only): keep past prompts' KV, retrieve entries by sentence
embeddings, reuse cached KV only when the cached prompt is an exact prefix of the new input (checked on tokens);
with no overlap, behaviour equals the baseline. kvmem's hash-chained chunks (`prefix.py`) already reuse common
prefixes, but in whole chunks only: a prompt sharing 300 tokens with a stored one gets 256 of them (chunk 256),
a prompt shorter than a chunk gets nothing. Here the granularity is the token, and the paper's "the cached
prompt is a prefix of the new one" is relaxed to "the longest common token prefix" (the cached prompt may go on
differently, e.g. another question after the same document).

    index = SemanticIndex(store)                  # semantic_index.py; store: a ChunkStore; embedder "minilm" by default
    logits, report = prefill_semantic(lm, KVCache(lm.model.config), ids, index)
    report.path                                   # "semantic" (a remembered prompt gave more) or "chunks"
    key, common = index.lookup(lm, other_ids)     # the remembered prompt sharing the most leading tokens

What a remembered prompt is stored as (a design choice, different from "one whole-prompt entry"): its full
chunks under the ordinary chained chunk keys (which `prefill`/`prefill_semantic` write anyway), plus one *tail*
entry for the partial last chunk, rows [floor(L / chunk) * chunk, L), under `prompt_key` (the span key of the
whole prompt in the store's raw namespace + "|prompt": it never equals a chunk key or a compressed span's key).
To reuse P tokens of a remembered prompt E, the pieces of E covering [0, P) are loaded: its chunks (the first
floor(P / chunk) have the new prompt's own keys, the next is E's and covers P) and, past E's last full chunk,
E's tail; the rows at positions >= P are dropped. Compared with one entry holding the whole prompt this stores
each token once (chunks + a tail under one chunk, not chunks + a second full copy), and it serves sliding-window
layers: such a layer holds only the last window of a prompt once prefilled, so a whole-prompt entry lacks the
rows a shorter prefix needs; a chunk stored right after it was computed keeps them (a partial prefix of a chunk
is served when every sliding window is longer than the chunk, e.g. Gemma 3's 512 > 256; the assembled rows are
checked and a candidate that lacks a row is skipped).

Nothing from the embedding is trusted: it only proposes the k nearest remembered prompts; the common prefix is
computed on token ids, and every piece goes through `ChunkStore.load` (checksum, model fingerprint, tokenizer,
codec, key, token range, row layout). A damaged or evicted piece drops that candidate; the prompt then gets what
exact chunk reuse gives. Reuse from an exact token prefix is exact: with the raw codec the reused rows are the
stored rows, bit for bit; logits differ from a cold prefill by float rounding only (the prompt is computed in
other pieces).

The index (`VectorIndex` over USearch, exact inner product of normalised embeddings) keeps each prompt's token
ids beside its vector; `save()` writes both (the index file at `path`, the ids at `path` + ".entries.json", each
checksummed, the second naming the first's SHA-256); a missing, corrupt or mismatched pair (another embedder,
tokenizer or dimension) is rebuilt empty with an `IndexWarning`, never trusted. Entries leave with the store's
pieces (see `SemanticIndex`): a tier's eviction or a discarded corrupt piece drops the prompts that need it at the
index's next use, and a proposed prompt whose piece turns out missing here is dropped at once; `forget` removes one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvmem.cache import KVCache
from kvmem.errors import KVMemError
from kvmem.reuse.pipeline import import_chunks
from kvmem.reuse.prefix import ReuseReport, compute_rest, prefill
from kvmem.reuse.semantic_index import Match, SemanticIndex, check_ids, check_plain
from kvmem.rows import ExportedRows
from kvmem.store.keys import chunk_keys
from kvmem.store.store import ChunkStore, layer_windows


@dataclass
class SemanticReport(ReuseReport):
    """A `ReuseReport` that also says which path the prefill took and what the lookup found."""

    path: str = "chunks"  # "semantic": a remembered prompt's rows past the shared whole chunks; "chunks": exact chunk reuse
    chunk_tokens: int = 0  # what the new prompt's own chunk keys gave
    candidate_tokens: int = 0  # the longest verified common prefix among the k nearest (capped at prompt - min_tail)
    candidates: int = 0  # remembered prompts the embedding proposed
    match_key: str | None = None  # the remembered prompt used (semantic path)
    match_score: float | None = None  # its embedding similarity
    lookup_s: float = 0.0  # embedding + search + token verification
    remember_s: float = 0.0  # saving the tail and adding the prompt to the index

    def summary(self) -> str:
        if self.path == "semantic":
            how = (f"semantic: {self.reused_tokens} tokens of a remembered prompt (exact chunk reuse gave "
                   f"{self.chunk_tokens}); lookup {self.lookup_s:.3f} s")
        else:
            how = f"chunks: best remembered prefix {self.candidate_tokens} tokens; lookup {self.lookup_s:.3f} s"
        return f"[{how}] " + super().summary()



def _truncate(layers: list[ExportedRows], end: int) -> list[ExportedRows]:
    """The rows at positions < end."""
    out = []
    for rows in layers:
        heads = []
        for head in rows.heads:
            keep = (head["positions"] < end).nonzero().flatten()
            heads.append({f: t.index_select(0, keep) for f, t in head.items()})
        out.append(ExportedRows(heads, rows.codec, rows.meta))
    return out


def _visible(pieces: list[list[ExportedRows]], windows: list[int | None], end: int) -> bool:
    """The pieces hold every row the token at `end` sees: all of [0, end), or a sliding layer's last window."""
    for l, window in enumerate(windows):
        want = range(max(0, end - window + 1), end) if window else range(end)
        for h in range(len(pieces[0][l].heads)):
            p = torch.cat([piece[l].heads[h]["positions"] for piece in pieces])
            p = p[p >= want.start]
            if p.numel() != len(want) or not torch.equal(p, torch.arange(want.start, want.stop, dtype=p.dtype)):
                return False
    return True


def _entry_pieces(store: ChunkStore, lm, match: Match, start_chunk: int, end: int, missed: set[str],
                  index: SemanticIndex | None = None) -> tuple[list, int]:
    """Load remembered prompt `match`'s pieces (verified `Loaded`s) from chunk `start_chunk` up to the one covering
    `end`; returns them and how far they reach (stops at a miss or a piece that fails verification; with `index`,
    the prompts that need a piece no tier holds are dropped from it)."""
    n, entry = store.chunk_size, match.ids.tolist()
    keys = chunk_keys(entry, n, store.namespace(lm))
    pieces, reach = [], start_chunk * n
    for j in range(start_chunk, -(-end // n)):
        key, t = (keys[j], n) if j < len(keys) else (match.key, len(entry) - j * n)
        if key in missed:
            break
        got = store.load(lm, key, j * n, t)
        if got is None:
            missed.add(key)
            if index is not None and store.reads:
                index.piece_missing(lm, key)
            break
        pieces.append(got)
        reach = min(end, j * n + t)
    return pieces, reach


@torch.no_grad()
def prefill_semantic(lm, cache: KVCache, ids: list[int], index: SemanticIndex, min_tail: int = 1, k: int = 4,
                     text: str | None = None, min_gain: int = 16, remember: bool = True,
                     store: ChunkStore | None = None, interrupt=None,
                     vector=None) -> tuple[torch.Tensor, SemanticReport]:
    """Prefill `ids` into the empty plain `cache`, reusing the most stored KV an exact prefix allows: the new
    prompt's own stored chunks, extended to the longest common token prefix with one of the k remembered prompts
    nearest by embedding when that gives at least `min_gain` more tokens (loading a piece costs a little); at
    least `min_tail` tokens are computed. Full chunks computed are stored, and (with `remember`) the prompt is
    remembered. With no candidate this is `prefill` with the store. Returns the last token's logits and a
    `SemanticReport` (`path` says which reuse it took). `store`: a policy view of the index's store (the server's
    `use_store` / `fill_store`); `interrupt()` is called before each computed piece (it raises to stop). `vector`: the
    prompt's embedding when the caller has it already."""
    ids = check_ids(lm, ids)
    check_plain(cache)
    if any(layer.is_initialized for layer in cache.layers):
        raise KVMemError("semantic reuse prefills an empty cache only")
    store = index.store if store is None else store
    report = SemanticReport(prompt_tokens=len(ids))
    limit = len(ids) - max(min_tail, 1)
    t = time.perf_counter()
    if vector is None:
        vector = index.embed(lm, ids, text) if len(index) or remember else None
    found = index.candidates(lm, ids, k, vector=vector) if vector is not None and store.reads else []
    report.lookup_s = time.perf_counter() - t
    report.candidates = len(found)
    report.candidate_tokens = max((min(m.common, limit) for m in found), default=0)
    if report.candidate_tokens < max(min_gain, 1):  # nothing a remembered prompt could add: exact chunk reuse
        logits, report = prefill(lm, cache, ids, store, min_tail, report, interrupt=interrupt)
        report.chunk_tokens = report.reused_tokens
    else:
        logits = _prefill_extended(lm, cache, ids, index, store, found, limit, min_gain, report, interrupt)
    if remember and store.writes:
        t = time.perf_counter()
        index.remember(lm, ids, cache, vector=vector, save_chunks=False, store=store)
        report.remember_s = time.perf_counter() - t
    return logits, report


def _prefill_extended(lm, cache: KVCache, ids: list[int], index: SemanticIndex, store: ChunkStore, found: list[Match],
                      limit: int, min_gain: int, report: SemanticReport, interrupt=None) -> torch.Tensor:
    """`prefill`'s loop, with the loaded prefix extended from a remembered prompt's pieces."""
    n = store.chunk_size
    keys = store.keys(lm, ids)
    loaded: list[list[ExportedRows]] = []
    missed: set[str] = set()
    for i, key in enumerate(keys):  # the new prompt's own chunks, as `prefill` loads them
        if (i + 1) * n > limit:
            break
        got = store.load(lm, key, i * n, n)
        if got is None:
            missed.add(key)
            break
        loaded.append(got.layers)
        report.add_load(got, n)
    chunk_end = report.chunk_tokens = len(loaded) * n
    reach, windows = chunk_end, layer_windows(lm.config)
    for match in found:  # longest common prefix first
        want = min(match.common, limit)
        if want < chunk_end + max(min_gain, 1):
            break
        pieces, got_to = _entry_pieces(store, lm, match, len(loaded), want, missed, index)
        if got_to >= chunk_end + max(min_gain, 1):
            extended = loaded + [_truncate(p.layers, got_to) for p in pieces]
            if _visible(extended, windows, got_to):
                loaded, reach = extended, got_to
                report.path, report.match_key, report.match_score = "semantic", match.key, match.score
                index.used(match.ids)
                first = len(loaded) - len(pieces)  # the chunk index of the first entry piece
                for i, p in enumerate(pieces):
                    start = (first + i) * n
                    span = min(n, len(match.ids) - start)  # the piece's tokens; those used end at got_to
                    report.tiers[p.tier] += 1
                    report.bytes_read += p.nbytes
                    report.read_s += p.read_s
                    report.decode_s += p.decode_s
                    report.saved_compute_s += (p.compute_s or 0.0) * (min(got_to, start + span) - start) / span
                break
    report.chunks_loaded = len(loaded)
    report.reused_tokens = reach
    if loaded:
        t = time.perf_counter()
        import_chunks(cache, loaded, reach)
        report.import_s = time.perf_counter() - t
    return compute_rest(lm, cache, ids, reach, store, keys, n, report, interrupt=interrupt)

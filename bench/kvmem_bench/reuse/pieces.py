"""A document's stored pieces, shared by the reuse runner and the codec frontier (neither report reaches a runner):
each chunk's rows as a store's first request computed them, and written to another store as `prefill` would."""

from __future__ import annotations

from kvmem.errors import KVMemError
from kvmem.reuse.prefix import TAIL
from kvmem.store import ChunkStore


def stored_pieces(lm, store: ChunkStore, doc: list[int], prompt: list[int]) -> list[tuple[int, int, list]]:
    """(start, tokens, rows) of each chunk of `doc` and of its partial last chunk, read back from the raw `store` that
    `prefill(prompt, context_end=len(doc))` wrote: each chunk's rows as they were when it was computed (read from
    the cache after the whole document, Gemma-3's sliding layers would have dropped the early chunks' rows)."""
    n, keys = store.chunk_size, store.keys(lm, prompt)
    out = []
    for start in range(0, len(doc), n):
        t = min(n, len(doc) - start)
        key, compression = (keys[start // n], None) if t == n else (store.span_key(lm, doc, TAIL), TAIL)
        got = store.load(lm, key, start, t, compression, exact=True)
        if got is None:
            raise KVMemError(f"the raw store lacks the chunk of tokens {start}..{start + t - 1} its prefill wrote")
        out.append((start, t, got.layers))
    return out


def save_document(lm, store: ChunkStore, doc: list[int], prompt: list[int], pieces) -> list[tuple]:
    """Write a document's pieces as `prefill(prompt, context_end=len(doc))` would; returns (key, start, tokens,
    compression) of each."""
    keys = store.keys(lm, prompt)
    entries = []
    for start, n, rows in pieces:
        key, compression = (keys[start // store.chunk_size], None) if n == store.chunk_size else (store.span_key(lm, doc, TAIL), TAIL)
        store.save(lm, key, rows, start, n, compression)
        entries.append((key, start, n, compression))
    return entries

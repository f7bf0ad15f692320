"""Chunk keys: a chained BLAKE2b hash over token ids, namespaced by model, codec and compression.

Chunk i of a token sequence covers tokens [i*N, (i+1)*N). Its key hashes the previous chunk's key with
this chunk's token ids, so a key names the whole prefix up to the end of its chunk: two prompts share
chunk i's key exactly when they share their first (i+1)*N tokens. The first key starts from the
namespace, so a chunk of another model, codec (or codec version) or compression is never found under
this namespace's keys. Python's `hash()` is never used: it differs between processes.

    >>> ns = namespace("f00", "raw", 1, None, 4)
    >>> a, b = chunk_keys(list(range(10)), 4, ns), chunk_keys(list(range(8)) + [99, 98], 4, ns)
    >>> len(a), a == b  # two full chunks each; the partial third chunk gets no key
    (2, True)
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST = 20  # bytes of BLAKE2b: 160 bits, collision-free for any store this side of the universe


def namespace(fingerprint: str, codec: str, codec_version: int, compression: str | None, chunk_size: int) -> str:
    """What a key belongs to: model fingerprint, codec spec and version, compression (method@ratio), chunk size."""
    return f"kvmem/1|model={fingerprint}|codec={codec}@{codec_version}|compression={compression or 'none'}|chunk={chunk_size}"


def _h(parent: bytes, ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(ids, dtype="<i8").tobytes(), digest_size=DIGEST).digest()


def chunk_keys(ids: list[int], chunk_size: int, ns: str) -> list[str]:
    """Hex keys of the full chunks of `ids` (the trailing partial chunk has none)."""
    key, out = ns.encode(), []
    for start in range(0, len(ids) - chunk_size + 1, chunk_size):
        key = _h(key, ids[start:start + chunk_size])
        out.append(key.hex())
    return out


def span_key(ids: list[int], ns: str) -> str:
    """One key for exactly these tokens, all of them (a compressed span is only valid for the whole span)."""
    return _h(ns.encode() + b"|span", ids).hex()


if __name__ == "__main__":
    import doctest

    doctest.testmod(verbose=True)

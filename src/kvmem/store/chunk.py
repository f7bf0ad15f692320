"""The stored form of one chunk: a checksummed frame around a safetensors payload.

    offset 0   8 bytes   magic b"KVMEMCK2" (the frame format; a change of layout changes it)
    offset 8   16 bytes  XXH3-128 of everything after it
    offset 24  ...       safetensors: the codec's tensors, 8-byte aligned, and the header under metadata["kvmem"]

The header (JSON) says what the chunk is: its key, the model fingerprint, the tokenizer hash, the codec
and its version, the first token and the token count, and the codec's own metadata. Nothing is decoded
before the checksum matches, and the reader compares the header with what it expects (`unpack` returns
it; `kvmem.store.store` checks it). The payload starts at a fixed offset, so a disk tier can map it.

The checksum guards against truncation and corruption, not against a writer who means harm (no unkeyed hash
does): XXH3 reads ~25 GB/s here against BLAKE2b's ~0.9, and every load of a 4k-token span hashes ~190 MB.
Frames of the first format (KVMEMCK1, BLAKE2b) are refused as not kvmem chunks: recomputed, never decoded.
"""

from __future__ import annotations

import json

import xxhash

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from kvmem.errors import KVMemError

MAGIC = b"KVMEMCK2"
HEADER = len(MAGIC) + 16


class CorruptChunk(KVMemError):
    """A stored chunk failed verification (checksum, framing, header); it is discarded and recomputed."""


def pack(tensors: dict[str, Tensor], header: dict) -> bytes:
    payload = st_save({k: t.contiguous() for k, t in tensors.items()}, metadata={"kvmem": json.dumps(header, sort_keys=True)})
    return MAGIC + xxhash.xxh3_128_digest(payload) + payload


def unpack(blob: bytes | memoryview) -> tuple[dict[str, Tensor], dict]:
    """Tensors and header of a stored chunk; raises CorruptChunk naming what is wrong."""
    blob = memoryview(blob)
    if len(blob) < HEADER or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CorruptChunk("not a kvmem chunk (bad magic or shorter than the frame)")
    payload = blob[HEADER:]
    if xxhash.xxh3_128_digest(payload) != bytes(blob[len(MAGIC):HEADER]):
        raise CorruptChunk(f"checksum mismatch ({len(blob)} bytes: truncated or altered)")
    try:
        payload = bytes(payload)
        tensors = st_load(payload)
        header = json.loads(_metadata(payload)["kvmem"])
    except Exception as e:  # noqa: BLE001 - a frame whose checksum matches but does not parse was written wrong
        raise CorruptChunk(f"chunk payload does not parse ({type(e).__name__}: {e})") from None
    return tensors, header


def _metadata(payload: bytes) -> dict:
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + n]).get("__metadata__", {})

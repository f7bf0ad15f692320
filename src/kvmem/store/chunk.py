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
import math
import warnings

import torch
import xxhash

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


def unpack(blob: bytes | memoryview, views: bool = False) -> tuple[dict[str, Tensor], dict]:
    """Tensors and header of a stored chunk; raises CorruptChunk naming what is wrong. The tensors share one private
    copy of the payload, or with `views` (and an immutable `bytes` blob) view the blob itself: no copy (at 8k tokens
    of SmolLM2 the copy, page faults included, was ~0.2 s of a ~0.75 s load), for a reader that copies the rows
    before anything writes them (the prefix loader imports them into the cache). Writing to such a view would
    alter the stored bytes (the next read's checksum would refuse them)."""
    views = views and isinstance(blob, bytes)
    blob = memoryview(blob)
    if len(blob) < HEADER or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CorruptChunk("not a kvmem chunk (bad magic or shorter than the frame)")
    payload = blob[HEADER:]
    if xxhash.xxh3_128_digest(payload) != bytes(blob[len(MAGIC):HEADER]):
        raise CorruptChunk(f"checksum mismatch ({len(blob)} bytes: truncated or altered)")
    try:
        if not views:
            return _parse(bytearray(payload))
        with warnings.catch_warnings():  # torch warns that the bytes are not writable: these views are only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return _parse(payload)
    except Exception as e:  # noqa: BLE001 - a frame whose checksum matches but does not parse was written wrong
        raise CorruptChunk(f"chunk payload does not parse ({type(e).__name__}: {e})") from None


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _parse(payload: bytearray | memoryview) -> tuple[dict[str, Tensor], dict]:
    """The safetensors payload as tensors that view its one private copy: `safetensors.torch.load` copies every
    tensor out of the bytes (and its header is parsed twice for the metadata), ~2x the work of a 4k span's load.
    Every tensor's extent is checked against the payload and its shape."""
    n = int.from_bytes(payload[:8], "little")
    if not 0 < n <= len(payload) - 8:
        raise ValueError(f"header length {n} outside the {len(payload)}-byte payload")
    entries = json.loads(bytes(payload[8:8 + n]))
    header = json.loads(entries.pop("__metadata__")["kvmem"])
    base, size = 8 + n, len(payload) - 8 - n
    tensors = {}
    for name, e in entries.items():
        dtype, shape, (a, b) = _DTYPES[e["dtype"]], e["shape"], e["data_offsets"]
        count = math.prod(shape)
        if not 0 <= a <= b <= size or b - a != count * dtype.itemsize:
            raise ValueError(f"tensor {name}: bytes [{a}, {b}) do not hold {shape} {e['dtype']} in {size}")
        tensors[name] = (torch.frombuffer(payload, dtype=dtype, count=count, offset=base + a) if count else
                         torch.empty(0, dtype=dtype)).view(shape)
    return tensors, header

"""The stored form of one chunk: a checksummed frame around a safetensors payload, verifiable layer by layer.

    offset 0   8 bytes   magic b"KVMEMCK3" (the frame format; a change of layout changes it)
    offset 8   16 bytes  XXH3-128 of the payload's safetensors header (its length field and JSON)
    offset 24  ...       safetensors: the codec's tensors, 8-byte aligned; the chunk's header under metadata["kvmem"]
                         and, under metadata["digests"], an XXH3-128 per group of tensors

A group is the tensors whose names share a first dotted component: a layer's (`"3.keys"`, `"3.1.values"`). Its digest
covers their bytes in name order. So a reader can verify one layer and use it while the next is still unchecked: the
prefix loader imports layer i+1 while the model runs layer i (`kvmem.reuse.pipeline`). `unpack` verifies every group
before it returns; `open_frame` verifies the header and leaves the groups to `Frame.verify`. Nothing is decoded before
the digests that cover it match, and the reader compares the header with what it expects (`kvmem.store.store`).

The header (JSON) says what the chunk is: its key, the model fingerprint, the tokenizer hash, the codec
and its version, the first token and the token count, and the codec's own metadata. The payload starts at a fixed
offset, so a disk tier can map it.

The checksums guard against truncation and corruption, not against a writer who means harm (no unkeyed hash does):
XXH3 reads ~25 GB/s here against BLAKE2b's ~0.9, and every load of a 4k-token span hashes ~190 MB. Frames of earlier
formats (KVMEMCK1: BLAKE2b; KVMEMCK2: one digest for the whole payload) are refused as not kvmem chunks: recomputed,
never decoded.
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

MAGIC = b"KVMEMCK3"
HEADER = len(MAGIC) + 16


class CorruptChunk(KVMemError):
    """A stored chunk failed verification (checksum, framing, header); it is discarded and recomputed."""


def group_of(name: str) -> str:
    """The group a tensor is verified with: its name's first dotted component (a codec's layer index)."""
    return name.split(".", 1)[0]


def pack(tensors: dict[str, Tensor], header: dict) -> bytes:
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    digests: dict[str, xxhash.xxh3_128] = {}
    for name in sorted(tensors):  # the reader hashes a group's byte ranges in the same order
        t = tensors[name]
        digest = digests.setdefault(group_of(name), xxhash.xxh3_128())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    payload = st_save(tensors, metadata={"kvmem": json.dumps(header, sort_keys=True),
                                         "digests": json.dumps({g: d.hexdigest() for g, d in digests.items()})})
    n = int.from_bytes(payload[:8], "little")
    return MAGIC + xxhash.xxh3_128_digest(payload[:8 + n]) + payload


class Frame:
    """A chunk whose header is verified: its tensors (views of the payload) and header; `verify(group)` checks a group's
    bytes before they are read, and `verified()` every group."""

    def __init__(self, tensors: dict[str, Tensor], header: dict, spans: dict[str, list[tuple[int, int]]],
                 digests: dict[str, str], payload: memoryview | bytearray):
        self.tensors, self.header = tensors, header
        self._spans, self._digests, self._payload = spans, digests, payload
        self._checked: set[str] = set()

    @property
    def groups(self) -> list[str]:
        return sorted(self._digests)

    def verify(self, group: str) -> None:
        """Raise CorruptChunk unless the bytes of `group`'s tensors are those written (a group with no tensors: fine)."""
        if group in self._checked or group not in self._digests:
            return
        digest = xxhash.xxh3_128()
        for a, b in self._spans.get(group, ()):
            digest.update(self._payload[a:b])
        if digest.hexdigest() != self._digests[group]:
            raise CorruptChunk(f"checksum mismatch in tensors {group}.* (altered)")
        self._checked.add(group)

    def verified(self) -> tuple[dict[str, Tensor], dict]:
        for group in self._digests:
            self.verify(group)
        return self.tensors, self.header


def unpack(blob: bytes | memoryview, views: bool = False) -> tuple[dict[str, Tensor], dict]:
    """Tensors and header of a stored chunk, every byte verified; raises CorruptChunk naming what is wrong. See
    `open_frame` for `views`."""
    return open_frame(blob, views).verified()


def open_frame(blob: bytes | memoryview, views: bool = False) -> Frame:
    """A stored chunk with its header verified (its groups are verified by `Frame.verify`); raises CorruptChunk naming
    what is wrong. The tensors share one private copy of the payload, or with `views` (and an immutable `bytes` blob)
    view the blob itself: no copy (at 8k tokens of SmolLM2 the copy, page faults included, was ~0.2 s of a ~0.75 s
    load), for a reader that copies the rows before anything writes them (the prefix loader imports them into the
    cache). Writing to such a view would alter the stored bytes (the next read's checksum would refuse them)."""
    views = views and isinstance(blob, bytes)
    blob = memoryview(blob)
    if len(blob) < HEADER + 8 or bytes(blob[:len(MAGIC)]) != MAGIC:
        raise CorruptChunk("not a kvmem chunk (bad magic, an earlier frame format, or shorter than the frame)")
    payload = blob[HEADER:]
    n = int.from_bytes(payload[:8], "little")
    if not 0 < n <= len(payload) - 8:
        raise CorruptChunk(f"header length {n} outside the {len(payload)}-byte payload (truncated or altered)")
    if xxhash.xxh3_128_digest(payload[:8 + n]) != bytes(blob[len(MAGIC):HEADER]):
        raise CorruptChunk(f"header checksum mismatch ({len(blob)} bytes: truncated or altered)")
    try:
        if not views:
            return _parse(bytearray(payload), n)
        with warnings.catch_warnings():  # torch warns that the bytes are not writable: these views are only read
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return _parse(payload, n)
    except CorruptChunk:
        raise
    except Exception as e:  # noqa: BLE001 - a frame whose checksum matches but does not parse was written wrong
        raise CorruptChunk(f"chunk payload does not parse ({type(e).__name__}: {e})") from None


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _parse(payload: bytearray | memoryview, n: int) -> Frame:
    """The safetensors payload as tensors that view it: `safetensors.torch.load` copies every tensor out of the bytes
    (and its header is parsed twice for the metadata), ~2x the work of a 4k span's load. Every tensor's extent is
    checked against the payload and its shape, and every tensor belongs to a group that has a digest."""
    entries = json.loads(bytes(payload[8:8 + n]))
    meta = entries.pop("__metadata__")
    header, digests = json.loads(meta["kvmem"]), json.loads(meta["digests"])
    base, size = 8 + n, len(payload) - 8 - n
    tensors, spans = {}, {}
    for name in sorted(entries):
        e = entries[name]
        dtype, shape, (a, b) = _DTYPES[e["dtype"]], e["shape"], e["data_offsets"]
        count = math.prod(shape)
        if not 0 <= a <= b <= size or b - a != count * dtype.itemsize:
            raise ValueError(f"tensor {name}: bytes [{a}, {b}) do not hold {shape} {e['dtype']} in {size}")
        if group_of(name) not in digests:
            raise CorruptChunk(f"tensor {name} is covered by no digest")
        spans.setdefault(group_of(name), []).append((base + a, base + b))
        tensors[name] = (torch.frombuffer(payload, dtype=dtype, count=count, offset=base + a) if count else
                         torch.empty(0, dtype=dtype)).view(shape)
    return Frame(tensors, header, spans, digests, payload)

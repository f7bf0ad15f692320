"""Keep computed KV across requests: chunk keys (keys.py), the checksummed chunk frame (chunk.py), codecs
(codecs.py: raw, quant:<scheme>, cachegen), byte tiers (tiers.py: memory, disk, Redis, Redis Cluster) and the
verifying `ChunkStore` (store.py). `kvmem.reuse` decides what to look up and how to use it."""

from kvmem.store.codec import Codec
from kvmem.store.codecs import get_codec
from kvmem.store.store import ChunkStore, StoreWarning
from kvmem.store.tiers import parse_stack

__all__ = ["ChunkStore", "Codec", "StoreWarning", "get_codec", "parse_stack"]

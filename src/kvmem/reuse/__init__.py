"""Reuse stored KV: exact prefixes (prefix.py, their layers put in place while the forward runs: pipeline.py), and
documents at other positions with selective recompute (blend.py: cacheblend, infoflow)."""

from kvmem.reuse.pipeline import import_chunks
from kvmem.reuse.prefix import ReuseReport, prefill

__all__ = ["ReuseReport", "import_chunks", "prefill"]

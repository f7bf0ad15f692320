"""Reuse stored KV: exact prefixes (prefix.py), and documents at other positions with selective recompute
(blend.py: cacheblend, infoflow)."""

from kvmem.reuse.prefix import ReuseReport, import_chunks, prefill

__all__ = ["ReuseReport", "import_chunks", "prefill"]

"""kvmem's benchmarks, one folder each (its runner, its report): longctx (the long-context suite, its cost, the race
against kvpress), speed, retrieval, quant, reuse, rag, serve (the load test), batching. `readme` writes the README's
results blocks from all of them; `records` and `stats` are what they share."""

from pathlib import Path

DATA = Path(__file__).parent / "data"  # the shipped questions (retrieval's second set, the served benchmarks' prompts)

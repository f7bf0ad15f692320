"""The README's results blocks, written by this one helper from every benchmark's results.

Each benchmark's report module says what its block holds (`README_MARKERS`, `readme_block(results)`, None when its
results are not there); this module puts each block between its markers, or appends it. Run after a benchmark:

    python -m kvmem_bench.readme quant        # one block
    python -m kvmem_bench.readme              # all of them
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType


def reports() -> dict[str, ModuleType]:
    """Benchmark name -> its report module, in the README's order."""
    from kvmem_bench.batching import report as batching
    from kvmem_bench.longctx import report as longctx
    from kvmem_bench.longgen import report as longgen
    from kvmem_bench.quant import report as quant
    from kvmem_bench.retrieval import report as retrieval
    from kvmem_bench.reuse import report as reuse
    from kvmem_bench.serve import report as serve

    return {"longctx": longctx, "longgen": longgen, "retrieval": retrieval, "quant": quant, "reuse": reuse, "serve": serve,
            "batching": batching}


def replace_block(readme: Path, markers: tuple[str, str], body: str) -> None:
    """Put `body` (which starts with markers[0] and ends with markers[1]) where the README's block is, or append it."""
    text = readme.read_text()
    opening = markers[0].split(":")[0]  # a block whose opening line's wording changed is still found
    if opening in text and markers[1] in text:
        start, end = text.index(opening), text.index(markers[1]) + len(markers[1])
        text = text[:start] + body + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + body + "\n"
    readme.write_text(text)


def update_readme(*names: str, readme: Path = Path("README.md"), results: Path = Path("results")) -> list[str]:
    """Rewrite the blocks of the named benchmarks (every one by default) from RESULTS; returns those written."""
    known = reports()
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"no README block for {', '.join(unknown)}; the benchmarks with one: {', '.join(known)}")
    written = []
    for name in names or known:
        block = known[name].readme_block(Path(results))
        if block is not None:
            replace_block(Path(readme), known[name].README_MARKERS, block)
            written.append(name)
    return written


if __name__ == "__main__":
    try:
        print("README blocks rewritten:", ", ".join(update_readme(*sys.argv[1:])) or "none (no results)")
    except ValueError as e:
        sys.exit(f"kvmem_bench.readme: {e}")

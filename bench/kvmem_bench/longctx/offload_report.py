"""The offload-and-retrieve comparison (`kvmem.compress.offload`) from a long-context run's records: each policy
against the eviction methods at the same keep ratio (= resident bytes, measured), with the full cache.

`python -m kvmem_bench.longctx.offload_report OUT` reads OUT/records.jsonl and writes OUT/offload.md: per method the
mean score over every task (stratified by task) with its bootstrap CI, its share of the full cache's score, the
resident bytes held (as a fraction of the full cache's, largest over samples) and what the tier held; then every
policy's paired difference from the best eviction method at that ratio (same samples), significant or not.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from kvmem.compress import OFFLOAD
from kvmem_bench.records import read_records
from kvmem_bench.stats import bootstrap_mean, paired_difference


def summarize(records: list[dict], setting: str = "agnostic") -> str:
    by: dict[tuple, dict] = defaultdict(dict)  # (method, ratio) -> (task, sample) -> record
    for r in records:
        if r["setting"] == setting:
            by[(r["method"], r["keep_ratio"])][(r["model"], r["length"], r["task"], r["sample"])] = r
    full = by.pop(("full", 1.0), {})
    ratios = sorted({ratio for _, ratio in by})
    lines = [f"# Offload and retrieve vs eviction ({setting})", ""]
    for ratio in ratios:
        methods = sorted(m for m, r in by if r == ratio)
        keys = sorted(set(full).intersection(*(by[(m, ratio)] for m in methods)))  # samples every method answered
        if not keys:
            continue
        tasks = [k[2] for k in keys]
        lines += [f"## keep ratio {ratio:g} ({len(keys)} samples: " + ", ".join(
            f"{t} {tasks.count(t)}" for t in sorted(set(tasks))) + ")", "",
            "| method | kind | score (95 % CI) | of full | resident / full (max) | tier / full |", "|---|---|---|---|---|---|"]
        f = bootstrap_mean([full[k]["score"] for k in keys], tasks)
        lines.append(f"| full | — | {f.estimate:.3f} [{f.lo:.3f}, {f.hi:.3f}] | 1.00 | 1.000 | — |")
        scores = {}
        for m in methods:
            rs = [by[(m, ratio)][k] for k in keys]
            scores[m] = [r["score"] for r in rs]
            s = bootstrap_mean(scores[m], tasks)
            resident = max(r["kv_bytes"] / r["kv_bytes_full"] for r in rs)
            tier = (f"{max(r['offloaded_bytes'] / r['kv_bytes_full'] for r in rs):.3f}"
                    if all("offloaded_bytes" in r for r in rs) else "—")
            kind = "offload" if m.split(":")[0] in OFFLOAD else "eviction"
            lines.append(f"| {m} | {kind} | {s.estimate:.3f} [{s.lo:.3f}, {s.hi:.3f}] | "
                         f"{s.estimate / f.estimate if f.estimate else float('nan'):.2f} | {resident:.3f} | {tier} |")
        evictors = [m for m in methods if m.split(":")[0] not in OFFLOAD]
        if evictors:
            best = max(evictors, key=lambda m: sum(scores[m]))
            lines += ["", f"Paired differences from the best eviction method at {ratio:g}, `{best}` (same samples, "
                      "stratified by task; * = the 95 % CI excludes 0):", ""]
            for m in methods:
                if m.split(":")[0] in OFFLOAD:
                    d = paired_difference(scores[m], scores[best], tasks)
                    lines.append(f"- {m} - {best}: {d.estimate:+.3f} [{d.lo:+.3f}, {d.hi:+.3f}]"
                                 + (" *" if d.significant else ""))
        lines.append("")
    return "\n".join(lines)


def main(out: str) -> None:
    path = Path(out)
    (path / "offload.md").write_text(summarize(read_records(path / "records.jsonl")))


if __name__ == "__main__":
    main(sys.argv[1])

"""The speed benchmark's report (results/speed/report.md, decode plot) and the speed section of the long-context
report: the goals said met or not, prefill, compression, decode and memory tables."""

from __future__ import annotations

from pathlib import Path

from kvmem_bench.speed import COMPRESS_GOAL, COMPRESSED_KINDS, DECODE_KINDS, KEEP_RATIO


def mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f} MiB"


def _groups(rows: list[dict], measure: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["measure"] == measure:
            out.setdefault((r["model"], r["length"]), []).append(r)
    return dict(sorted(out.items()))


def goals(rows: list[dict]) -> dict[str, dict]:
    """The two goals, checked on the measurements: met / not met and the numbers behind each."""
    # methods that run the model (kvzip's reconstruction) cost a multiple of the prefill by design: reported apart
    compress_rows = [r for r in rows if r["measure"] == "compress" and not r.get("needs_model")]
    over = [r for r in compress_rows if r["fraction_of_prefill"] > COMPRESS_GOAL]
    worst = max(compress_rows, key=lambda r: r["fraction_of_prefill"], default=None)
    ratio_rows = [r for r in rows if r["measure"] == "decode" and r["cache"] in COMPRESSED_KINDS]
    # "No slower": the geometric-mean ratio is <= 1, or its 95% interval includes 1 (not measurably slower).
    slower = [r for r in ratio_rows if r["ratio_lo"] > 1.0]
    return {
        "compress": dict(met=bool(compress_rows) and not over, checked=len(compress_rows),
                         over=[(r["model"], r["context_tokens"], r["method"], r["budget"], r["fraction_of_prefill"])
                               for r in over],
                         worst=worst and (worst["model"], worst["context_tokens"], worst["method"], worst["budget"],
                                          worst["fraction_of_prefill"])),
        "decode": dict(met=bool(ratio_rows) and not slower, checked=len(ratio_rows),
                       slower=[(r["model"], r["context_tokens"], r["cache"], r["ratio_to_dynamic"]) for r in slower]),
    }


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def speed_section(rows: list[dict]) -> list[str]:
    """Markdown lines: how it was measured, the two goals, then decode, prefill / compression and memory
    tables per model x context length (from the rows of results.json)."""
    g = goals(rows)
    threads = sorted({r["threads"] for r in rows})
    lines = ["## Speed and memory", "",
             f"torch with {', '.join(map(str, threads))} thread(s). Prefill, compression and decode are timed in one "
             "process per model, the configurations interleaved; decode feeds the same token each step with "
             "`logits_to_keep=1`, and kvmem caches drop their scorer observations before decoding (as "
             f"`answer()` does). Compressed caches keep {KEEP_RATIO} of each layer's tokens with snapkv; adaptive: "
             "a layer's heads share its budget, so they hold different numbers of tokens (the ragged storage path). "
             "A model with one KV head per layer (Gemma-3-270M) has nothing to share: there adaptive equals uniform. "
             "Memory: one fresh process per row (load, prefill, decode); peak RSS is VmHWM reset after the model "
             "is loaded, so it is the prefill + decode peak; " + _malloc_note(rows) + ".", ""]
    for r in {r["model"]: r for r in rows if r["context_tokens"] < r["length"]}.values():  # lengths cut to fit
        lines += [f"{r['model']}'s context is {r['max_context']} tokens: its {r['length']}-token length runs at "
                  f"{r['context_tokens']} tokens, leaving room for the tokens decoded after the prefill.", ""]
    c, d = g["compress"], g["decode"]
    w = c["worst"]
    lines.append(f"* **Compression adds <= {COMPRESS_GOAL:.0%} to prefill** (tracking excluded): {_met(c['met'])}; "
                 f"{len(c['over'])} of {c['checked']} (model, length, method) above"
                 + (f"; the slowest is {w[2]} ({w[3]}) on {w[0]} @ {w[1]} tokens, {100 * w[4]:.2f}% of the untracked "
                    "prefill." if w else "."))
    runs_model = [r for r in rows if r["measure"] == "compress" and r.get("needs_model")]
    if runs_model:
        from kvmem.compress import get_method  # torch: only for a report with such methods
        lines.append("* Methods that run the model (reconstruction, RoPE or calibration; not in the goal above) cost, "
                     "as a multiple of the untracked prefill, paid once for a cache that is then reused: "
                     + "; ".join(f"{r['method']}{'' if r['budget'] == get_method(r['method']).budget else ':budget=' + r['budget']}"
                                 f" {r['fraction_of_prefill']:.2f}x on {r['model']} @ {r['context_tokens']}"
                                 for r in runs_model) + ".")
    tracked = [(r["model"], r["context_tokens"], r["median_s"] / u["median_s"]) for r in rows for u in rows
               if r["measure"] == u["measure"] == "prefill" and r["cache"] == "kvmem-tracked" and u["cache"] == "kvmem"
               and (r["model"], r["length"]) == (u["model"], u["length"])]
    lines.append("* h2o also needs the prefill tracked (`track_attention=True`), reported apart: tracked / untracked "
                 "prefill time " + ", ".join(f"{m} @ {n} {x:.2f}x" for m, n, x in tracked) + ".")
    ratios = [r for r in rows if r["measure"] == "decode" and r["cache"] in COMPRESSED_KINDS]
    lines.append(f"* **Decode from a compressed cache is no slower than from DynamicCache**: {_met(d['met'])} (met "
                 "when the geometric mean of the per-step ratios is <= 1 or its 95% bootstrap interval includes 1); "
                 "compressed / DynamicCache ms per token: "
                 + "; ".join(f"{r['model']} @ {r['context_tokens']} {r['cache']} {r['ratio_to_dynamic']:.2f} "
                             f"[{r['ratio_lo']:.2f}, {r['ratio_hi']:.2f}]" for r in ratios) + ".")
    lines += ["", "### Decode (ms per token: median [quartiles] over the timed steps)", "",
              "| model | context | " + " | ".join(DECODE_KINDS) + " | compressed / DynamicCache: uniform; adaptive |",
              "|---|---|" + "---|" * (len(DECODE_KINDS) + 1)]
    for (model, _), rs in _groups(rows, "decode").items():
        by = {r["cache"]: r for r in rs}
        cells = [f"{by[k]['median_ms']:.1f} [{by[k]['q25_ms']:.1f}, {by[k]['q75_ms']:.1f}]" for k in DECODE_KINDS]
        ratio = "; ".join(f"{by[k]['ratio_to_dynamic']:.2f} [{by[k]['ratio_lo']:.2f}, {by[k]['ratio_hi']:.2f}]"
                          for k in COMPRESSED_KINDS)
        lines.append(f"| {model} | {rs[0]['context_tokens']} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "### Prefill (seconds) and compression (% of the untracked kvmem prefill)", "",
              "DynamicCache runs on the same model object, under kvmem's attention function: its decode steps are "
              "transformers' SDPA, but on Gemma-3 its prefill's sliding-window layers read only their window, as "
              "kvmem's do (stock transformers attends over the whole context under a mask there; timed apart in "
              "`results/race/prefill-timing.jsonl`).", "",
              "| model | context | DynamicCache | kvmem | kvmem tracked | " + " | ".join(
                  f"{m}{' adaptive' if b == 'adaptive' else ''}" for m, b in _compress_columns(rows)) + " |",
              "|---|---|---|---|---|" + "---|" * len(_compress_columns(rows))]
    compress_groups = _groups(rows, "compress")
    for key, rs in _groups(rows, "prefill").items():
        by = {r["cache"]: r["median_s"] for r in rs}
        comp = {(r["method"], r["budget"]): r["fraction_of_prefill"] for r in compress_groups.get(key, [])}
        lines.append(f"| {key[0]} | {rs[0]['context_tokens']} | {by['dynamic']:.2f} | {by['kvmem']:.2f} | "
                     f"{by['kvmem-tracked']:.2f} | "
                     + " | ".join(f"{100 * comp[mb]:.2f}%" if mb in comp else "–" for mb in _compress_columns(rows)) + " |")
    lines += ["", "### Memory (one process per row: load, prefill, decode)", "",
              "| model | context | cache | KV held | peak RSS | RSS after load | peak - after load | ragged layers |",
              "|---|---|---|---|---|---|---|---|"]
    for _, rs in _groups(rows, "memory").items():
        for r in sorted(rs, key=lambda r: DECODE_KINDS.index(r["cache"])):
            extra = (r["peak_rss_bytes"] - r["rss_loaded_bytes"]) if r["peak_rss_bytes"] and r["rss_loaded_bytes"] else None
            lines.append(f"| {r['model']} | {r['context_tokens']} | {r['cache']} | {mib(r['kv_bytes'])} | "
                         f"{mib(r['peak_rss_bytes'])} | {mib(r['rss_loaded_bytes'])} | {mib(extra)} | {r['ragged_layers']} |")
    return lines


def _malloc_note(rows: list[dict]) -> str:
    values = {r.get("malloc_mmap_threshold") for r in rows if r["measure"] == "memory"}
    if values == {None}:
        return ("glibc's default malloc (freed tensors stay in its heap: two runs of one configuration can peak "
                "100 MiB apart)")
    return (f"malloc's mmap threshold fixed at {', '.join(sorted(map(str, values - {None})))} bytes "
            "(MALLOC_MMAP_THRESHOLD_), so freed tensors go back to the OS and the peak is what was live (with "
            "glibc's default, two runs of one configuration peaked 90-130 MiB apart)")


def _compress_columns(rows: list[dict]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["method"], r["budget"]) for r in rows if r["measure"] == "compress"))


def command(config: dict) -> str:
    """The `kvmem eval` command line of a run (from the config recorded in results.json)."""
    from kvmem.compress import METHODS  # torch; the report needs it only here

    methods = [m for m, cls in METHODS.items() if m != "full" and not cls.decode_phase]  # SpeedConfig's default
    return (f"kvmem eval --suite speed --models {','.join(config['models'])} "
            f"--lengths {','.join(map(str, config['lengths']))}"
            + (f" --methods {','.join(config['methods'])}" if config["methods"] != methods else "")
            + (f" --threads {config['threads']}" if config["threads"] else "") + f" --out {config['out']}")


def report(rows: list[dict], meta: dict, plot: Path | None = None) -> str:
    lines = ["# kvmem speed and memory benchmark", "",
             f"Commit {meta['commit']}{' with uncommitted changes' if meta.get('uncommitted_changes') else ''}, "
             f"{meta['date']}, torch {meta['torch']}, {meta['cpus']} CPUs ({meta['machine']}); "
             f"load average {meta['load_average_start'][0]:.2f} at the start and {meta['load_average_end'][0]:.2f} at "
             f"the end (other work on the machine slows every configuration alike only while it is steady); "
             f"wall time {meta['wall_s'] / 60:.1f} min. Command: `{command(meta['config'])}`; results.json has "
             "every measurement (each step, each repeat, ru_maxrss).", ""]
    lines += speed_section(rows)
    lines += [f"- Not measured: {r['method']} ({r['budget']}) on {r['model']} @ {r['context_tokens']}: {r['reason']}"
              for r in rows if r["measure"] == "skipped"]
    if plot is not None:
        lines += ["", f"![decode ms per token vs context length]({plot.name})"]
    return "\n".join(lines) + "\n"


def plot_decode(rows: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if r["measure"] == "decode"]
    models = sorted({r["model"] for r in decode})
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for kind in DECODE_KINDS:
            rs = sorted((r for r in decode if r["model"] == model and r["cache"] == kind), key=lambda r: r["context_tokens"])
            x = [r["context_tokens"] for r in rs]
            y = [r["median_ms"] for r in rs]
            err = [[r["median_ms"] - r["q25_ms"] for r in rs], [r["q75_ms"] - r["median_ms"] for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=kind)
        ax.set_title(f"{model}: decode")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per token (median, quartiles)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

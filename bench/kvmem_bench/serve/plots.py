"""The load test's plots: TTFT per phase, RSS over time, and each soak (Redis; a Redis Cluster's node) with the
outage shaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvmem_bench.serve import NOT_LOAD, PHASE_LABELS, wrong_answers


def plots(data: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = {k: v for k, v in data["phases"].items() if k not in NOT_LOAD}
    made = []
    colours = {"store_on": "tab:blue", "store_off": "tab:orange", "soak": "tab:green", "cluster_soak": "tab:purple"}
    compared = [p for p in ("store_on", "store_off") if p in phases]
    if compared:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name in compared:
            ttft = np.sort([r["ttft_s"] for r in phases[name]["requests"] if not r["warmup"] and r["status"] == "ok"])
            if ttft.size:
                ax.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", color=colours[name],
                        label=f"{PHASE_LABELS[name]} (n={ttft.size})")
            for r in phases[name]["requests"]:
                if r["warmup"] and r["ttft_s"] is not None:
                    ax.axvline(r["ttft_s"], color=colours[name], ls="--", lw=1, label=f"{PHASE_LABELS[name]}: warm-up")
        ax.set(xscale="log", ylim=(0, 1.02), xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT, steady state (CDF)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=120)
        plt.close(fig)
        made.append("ttft.png")
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, phase in phases.items():
        if phase["rss"]:
            t, kib = zip(*phase["rss"])
            ax.plot(t, np.asarray(kib) / 1024, color=colours.get(name), label=PHASE_LABELS.get(name, name))
    for name, what in (("soak", "soak: Redis down"), ("cluster_soak", "cluster soak: a node down")):
        if name in phases and phases[name].get("redis_down_s") is not None:
            ax.axvspan(phases[name]["redis_down_s"], phases[name]["redis_up_s"], color=colours[name], alpha=0.12,
                       label=what)
    ax.set(xlabel="seconds from the phase's start", ylabel="server RSS (MiB)", title="server RSS over time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=120)
    plt.close(fig)
    made.append("rss.png")
    for name, png, what in (("soak", "soak.png", "Redis"), ("cluster_soak", "cluster_soak.png", "a cluster node")):
        phase = phases.get(name)
        if phase and phase.get("redis_down_s") is not None:
            outage_plot(phase, out / png, what, wrong=name == "cluster_soak")
            made.append(png)
    return made


def outage_plot(phase: dict, path: Path, what: str, wrong: bool = False) -> None:
    """TTFT of each request against its start, the outage shaded; whole loads, part loads and misses apart, errors
    as crosses and, with `wrong`, answers that differ from the reference ringed in red."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axvspan(phase["redis_down_s"], phase["redis_up_s"], color="grey", alpha=0.2, label=f"{what} down")
    ok = [r for r in phase["requests"] if r["status"] == "ok" and not r["warmup"]]
    # the most any request loaded before the outage: the whole stored prefix (on a cluster a request may load part)
    most = max((r["cached_tokens"] or 0 for r in ok if r["t_end_s"] <= phase["redis_down_s"]), default=1)
    cached = lambda r: r["cached_tokens"] or 0  # noqa: E731
    for label, keep, colour in (("loaded the whole stored prefix", lambda r: cached(r) >= max(most, 1), "tab:blue"),
                                ("loaded part of it, computed the rest", lambda r: 0 < cached(r) < most, "tab:green"),
                                ("computed (miss)", lambda r: cached(r) == 0, "tab:orange")):
        pts = [(r["t_start_s"], r["ttft_s"]) for r in ok if keep(r)]
        if pts:
            ax.scatter(*zip(*pts), s=12, color=colour, label=label)
    warm = [r for r in phase["requests"] if r["warmup"] and r["ttft_s"] is not None]
    if warm:
        ax.scatter([r["t_start_s"] for r in warm], [r["ttft_s"] for r in warm], marker="*", s=90, color="k",
                   label="warm-up (fills the store)")
    bad = [r["t_start_s"] for r in phase["requests"] if r["status"] != "ok"]
    if bad:
        ax.scatter(bad, [min((r["ttft_s"] for r in ok), default=0.01)] * len(bad), marker="x", color="red",
                   label="error / 429")
    if wrong:
        differ, checked = wrong_answers(phase)
        if differ:
            ax.scatter([r["t_start_s"] for r in differ], [r["ttft_s"] for r in differ], s=80, facecolors="none",
                       edgecolors="red", label=f"wrong output ({len(differ)} of {checked} answers)")
        else:
            ax.plot([], [], " ", label=f"wrong outputs: 0 of {checked} answers")
    ax.set(yscale="log", xlabel="request start (s from the soak's start)", ylabel="TTFT (s)",
           title=f"soak: TTFT over time, {what} killed and restarted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

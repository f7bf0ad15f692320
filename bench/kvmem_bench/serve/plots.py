"""The load test's plots: TTFT per phase, RSS over time, and the soak with Redis down and back."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvmem_bench.serve import NOT_LOAD, PHASE_LABELS


def plots(data: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = {k: v for k, v in data["phases"].items() if k not in NOT_LOAD}
    made = []
    colours = {"store_on": "tab:blue", "store_off": "tab:orange", "soak": "tab:green"}
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
    if "soak" in phases and phases["soak"].get("redis_down_s") is not None:
        ax.axvspan(phases["soak"]["redis_down_s"], phases["soak"]["redis_up_s"], color="tab:green", alpha=0.12,
                   label="soak: Redis down")
    ax.set(xlabel="seconds from the phase's start", ylabel="server RSS (MiB)", title="server RSS over time")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rss.png", dpi=120)
    plt.close(fig)
    made.append("rss.png")
    soak = phases.get("soak")
    if soak and soak.get("redis_down_s") is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.axvspan(soak["redis_down_s"], soak["redis_up_s"], color="grey", alpha=0.2, label="Redis down")
        ok = [r for r in soak["requests"] if r["status"] == "ok" and not r["warmup"]]
        for label, keep, colour in (("loaded from the store", lambda r: (r["cached_tokens"] or 0) > 0, "tab:blue"),
                                    ("computed (miss)", lambda r: not (r["cached_tokens"] or 0) > 0, "tab:orange")):
            pts = [(r["t_start_s"], r["ttft_s"]) for r in ok if keep(r)]
            if pts:
                ax.scatter(*zip(*pts), s=12, color=colour, label=label)
        warm = [r for r in soak["requests"] if r["warmup"] and r["ttft_s"] is not None]
        if warm:
            ax.scatter([r["t_start_s"] for r in warm], [r["ttft_s"] for r in warm], marker="*", s=90, color="k",
                       label="warm-up (fills the store)")
        bad = [r["t_start_s"] for r in soak["requests"] if r["status"] != "ok"]
        if bad:
            ax.scatter(bad, [min((r["ttft_s"] for r in ok), default=0.01)] * len(bad), marker="x", color="red",
                       label="error / 429")
        ax.set(yscale="log", xlabel="request start (s from the soak's start)", ylabel="TTFT (s)",
               title="soak: TTFT over time, Redis killed and restarted")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=120)
        plt.close(fig)
        made.append("soak.png")
    return made

"""The report's PNG plots (matplotlib, Agg: no display needed)."""
from __future__ import annotations

from pathlib import Path

from .runs import Run

PLOTS = ("loss_vs_time.png", "loss_vs_bytes.png", "time_breakdown.png", "tokens_per_s.png")


def write_plots(runs: list[Run], out: Path, target: float | None) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    for name, key, xlabel, scale in (("loss_vs_time.png", "time_s", "training time (s)", 1.0),
                                     ("loss_vs_bytes.png", "wire_bytes", "MB sent (all ranks)", 1e-6)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for run in runs:
            curve = run.curve
            ax.plot([getattr(p, key) * scale for p in curve], [p.val_loss for p in curve], marker="o",
                    markersize=3, label=run.label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:.3f}")
        if key == "wire_bytes" and any(p.wire_bytes > 0 for r in runs for p in r.curve):
            ax.set_xscale("symlog", linthresh=max(1e-3, min((p.wire_bytes * scale for r in runs for p in r.curve
                                                             if p.wire_bytes > 0), default=1.0)))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    # Per rank, averaged over ranks: forward/backward (slowdown included), waits on the
    # network, and the rest of the wall time (optimizer, waiting for slower ranks, evaluation).
    labels = [r.label for r in runs]
    compute, exposed, idle = [], [], []
    for r in runs:
        s = r.summary
        c = sum(s["compute_s_per_rank"]) / s["workers"]
        e = sum(s["exposed_comm_s_per_rank"]) / s["workers"]
        compute.append(c)
        exposed.append(e)
        idle.append(max(0.0, s["wall_s"] - c - e))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar(labels, compute, label="compute")
    ax.bar(labels, exposed, bottom=compute, label="exposed communication")
    ax.bar(labels, idle, bottom=[c + e for c, e in zip(compute, exposed)], label="idle / other")
    ax.set_ylabel("seconds per rank (mean over ranks)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=30)
    save(fig, "time_breakdown.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.bar(labels, [r.summary["tokens_per_s"] for r in runs], color="tab:green")
    ax.set_ylabel("tokens/s (all workers)")
    ax.tick_params(axis="x", labelrotation=30)
    save(fig, "tokens_per_s.png")
    return written

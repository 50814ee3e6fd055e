"""The report's PNG plots (matplotlib, Agg: no display needed), made to be shown on a slide:
a title naming the setup, units on the axes, a style and a marker per run (ddp and zero1
trace the same curve), each run's crossing of the target marked, and the loss axis sized
to where the curves cross the target rather than to the first, untrained evaluations."""
from __future__ import annotations

import textwrap
from pathlib import Path

from ...metrics.levels import LEVEL_WORDS
from .levels import leveled, run_levels
from .rank_plot import draw_rank_breakdown
from ...metrics.runs import RecordedRun, reach

PLOTS = ("loss_vs_time.png", "loss_vs_bytes.png", "time_breakdown.png", "rank_breakdown.png", "tokens_per_s.png")
STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "h"]
LOSS = "validation loss (nats/token)"
# The loss axis shows the target at about a third of its height: the best loss below it,
# and this many times that distance above it.
ABOVE_TARGET = 2.0
# About what fits across a figure's title at its size; a longer setting (two links, with
# replica groups) wraps rather than running off both edges.
TITLE_CHARS = 95


def write_plots(runs: list[RecordedRun], out: Path, target: float | None, setting: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name, what):
        fig.suptitle(f"{what}\n{textwrap.fill(setting, TITLE_CHARS)}", fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    for name, key, xlabel, scale, what in (
            ("loss_vs_time.png", "time_s", "training time (s; evaluation excluded)", 1.0, "Validation loss vs time"),
            ("loss_vs_bytes.png", "wire_bytes", "data sent, all ranks (MB)", 1e-6, "Validation loss vs data sent")):
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        _draw_loss(ax, runs, target, key, xlabel, scale)
        save(fig, name, what)
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    _draw_time_breakdown(ax, runs)
    save(fig, "time_breakdown.png", "Where the time went")
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    draw_rank_breakdown(ax, runs)
    save(fig, "rank_breakdown.png", "Where each rank's time went")
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    timed = [r for r in runs if r.summary["tokens_per_s"] is not None]  # not a run that did not finish
    ax.bar([r.label for r in timed], [r.summary["tokens_per_s"] for r in timed], color="tab:green")
    ax.set_ylabel("throughput (tokens/s, all workers)")
    ax.tick_params(axis="x", labelrotation=30)
    save(fig, "tokens_per_s.png", "Training throughput")
    return written


def _draw_loss(ax, runs: list[RecordedRun], target: float | None, key: str, xlabel: str, scale: float) -> None:
    """Validation loss against `key` of each curve point (time_s or wire_bytes), each run's
    crossing of the target starred."""
    log_x = key == "wire_bytes" and _log_worthy([p.wire_bytes for r in runs for p in r.curve])
    for i, run in enumerate(runs):
        points = [p for p in run.curve if p.wire_bytes > 0 or not log_x]  # 0 has no place on a log axis
        label = run.label + (f" ({len(run.curve) - len(points)} points at 0 MB not shown)"
                             if len(points) < len(run.curve) else "")
        line, = ax.plot([getattr(p, key) * scale for p in points], [p.val_loss for p in points],
                        linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)], markersize=5,
                        markerfacecolor="none", linewidth=1.6, alpha=0.9, label=label, zorder=3 + len(runs) - i)
        hit = reach(run.curve, target, key) if target is not None else None
        if hit is not None and (hit > 0 or not log_x):
            ax.plot([hit * scale], [target], marker="*", markersize=13, color=line.get_color(),
                    markeredgecolor="black", markeredgewidth=0.6, linestyle="none", zorder=10)
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1,
                   label=f"target {target:.4f} (★ where each run reaches it)")
        ax.set_ylim(*_loss_range(runs, target))
    if log_x:
        ax.set_xscale("log")
    else:
        ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(LOSS)
    ax.grid(alpha=0.3, which="both" if log_x else "major")
    ax.legend(fontsize=8)


def _draw_time_breakdown(ax, runs: list[RecordedRun]) -> None:
    # Per rank, averaged over ranks: forward/backward (slowdown included), waits on the
    # network, and the rest of the wall time (optimizer, waiting for slower ranks, evaluation).
    # With replica groups in the report the waits are split by level: the slow link's first.
    labels = [r.label for r in runs]
    by_level = any(leveled(r) for r in runs)
    compute, waits, idle = [], {level: [] for level in (LEVEL_WORDS if by_level else ["all"])}, []
    for r in runs:
        s = r.summary
        c = sum(s["compute_s_per_rank"]) / s["workers"]
        e = sum(s["exposed_comm_s_per_rank"]) / s["workers"]
        compute.append(c)
        if by_level:
            for level, (_, waited) in run_levels(r).items():
                waits[level].append(waited)
        else:
            waits["all"].append(e)
        idle.append(max(0.0, s["wall_s"] - c - sum(w[-1] for w in waits.values())))
    ax.bar(labels, compute, label="compute (forward, backward)")
    bottom = list(compute)
    for (level, seconds), hatch in zip(waits.items(), ("//", "\\\\")):
        where = f", {LEVEL_WORDS[level]}" if level in LEVEL_WORDS else ""
        ax.bar(labels, seconds, bottom=bottom, label=f"waiting on the network (exposed communication{where})",
               hatch=hatch)
        bottom = [b + w for b, w in zip(bottom, seconds)]
    ax.bar(labels, idle, bottom=bottom, label="other (optimizer, evaluation, "
           "waiting for slower ranks)", hatch="..")
    ax.set_ylabel("wall time per rank (s, mean over ranks)")
    ax.set_ylim(0, 1.4 * max(b + i for b, i in zip(bottom, idle)))  # room for the legend
    ax.legend(fontsize=8, loc="upper center")
    ax.tick_params(axis="x", labelrotation=30)


def _log_worthy(values: list[float]) -> bool:
    """A log axis when the positive values span more than a factor of 10 (bytes of
    compressing and plain strategies do); values at 0 are then left out of the plot."""
    positive = [v for v in values if v > 0]
    return bool(positive) and max(positive) > 10 * min(positive)


def _loss_range(runs: list[RecordedRun], target: float) -> tuple[float, float]:
    losses = [p.val_loss for r in runs for p in r.curve]
    best = min(losses, default=target)
    below = max(target - best, 0.02 * abs(target))  # a run that ends at the target still shows a margin
    top = min(target + ABOVE_TARGET * below, max(losses, default=target))
    return best - 0.1 * below, max(top, target + 0.1 * below)

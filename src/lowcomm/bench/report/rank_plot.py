"""The report's per-rank time plot: each rank's wall time as compute, exposed communication and
the rest, stacked, so a straggler (one tall compute bar) and the ranks waiting for it (tall
communication bars beside it) are told apart at a glance -- the mean over ranks of
time_breakdown.png hides exactly that."""
from __future__ import annotations

from ...metrics.runs import RecordedRun
from .slowed import rank_times

PARTS = (("compute (forward, backward)", None),
         ("waiting on the network (exposed communication)", "//"),
         ("other (optimizer, evaluation, waiting outside collectives)", ".."))


def draw_rank_breakdown(ax, runs: list[RecordedRun]) -> None:
    """One stacked bar per rank of each run, runs side by side ("ddp r0", "ddp r1", ...)."""
    labels, stacks = [], []
    for run in runs:
        for rank, times in enumerate(rank_times(run)):
            labels.append(f"{run.label} r{rank}" if len(runs) > 1 else f"rank {rank}")
            stacks.append(times)
    bottom = [0.0] * len(stacks)
    for i, (label, hatch) in enumerate(PARTS):
        seconds = [s[i] for s in stacks]
        ax.bar(labels, seconds, bottom=bottom, label=label, hatch=hatch)
        bottom = [b + s for b, s in zip(bottom, seconds)]
    ax.set_ylabel("wall time (s)")
    ax.set_ylim(0, 1.4 * max(bottom, default=1.0) or 1.0)  # room for the legend
    ax.legend(fontsize=8, loc="upper center")
    ax.tick_params(axis="x", labelrotation=30 if len(labels) > 4 else 0)

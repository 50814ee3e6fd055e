"""The comparison table: one row per run (or failure), numbers straight from summary.json
and the step log, written as Markdown and as JSON."""
from __future__ import annotations

import math

from .conditions import contention, load_of, timing_dependent
from .levels import COLUMNS as LEVEL_COLUMNS
from .levels import level_cells
from ...metrics.runs import Failed, Point, RecordedRun, reach
from .setup import setup_of

# (key, header, format): the Markdown shows each number in this format; report.json has it unrounded.
COLUMNS = [
    ("final_val_loss", "final val loss", "{:.4f}"),
    ("tokens", "tokens trained", "{:,}"),
    ("time_to_target_s", "time to target (s)", "{:.1f}"),
    ("mb_to_target", "MB sent to target (all ranks)", "{:.2f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("wire_mb_per_rank_per_step", "wire MB/step/rank", "{:.3f}"),
    ("exposed_comm_pct", "exposed comm %", "{:.1f}"),
    ("optimizer_state_mb_per_rank", "optimizer state MB/rank", "{:.2f}"),
    ("peak_mem_mib", "peak memory MiB", "{:.0f}"),
    ("load", "load at end", "{:.1f}"),
]
# What a cell shows where its figure is missing: a target not reached, or a figure not recorded.
MISSING = {"time_to_target_s": "not reached", "mb_to_target": "not reached"}
TIMING_MARK = " ‡"  # beside a run whose own result moves with the timing (conditions.timing_dependent)


# A final validation loss this far above the run's own best means it got worse at its end (a
# late outer step that moved the model away, an instability), not the noise of validation
# (a few batches: about 1 % between neighbouring points of a run that still improves).
REGRESSED = 0.05

# Runs with outer syncs (the local-SGD family): what each sync left exposed, on average.
OUTER_COLUMN = ("exposed_s_per_outer_sync", "exposed s per outer sync", "{:.3f}")


def exposed_per_outer_sync(entry) -> float | None:
    """The run's exposed communication (each step's slowest wait, summed) over its outer syncs;
    None for a strategy without outer syncs."""
    syncs = entry.summary.get("outer_syncs")
    if not syncs:
        return None
    return sum(rec["exposed_comm_s"] for rec in entry.steps) / syncs


def starting_loss(entry) -> float | None:
    """The untrained model's loss: the run's first step's training loss (None where not logged)."""
    first = entry.steps[0].get("loss") if entry.steps else None
    return first if first is not None and math.isfinite(first) else None


def diverged(entry) -> bool:
    """Did the run end above the loss it started at? Its final loss then says nothing about how
    fast the strategy reaches a target, and as the target it would make every run "reach" it."""
    start, final = starting_loss(entry), entry.summary["final_val_loss"]
    return start is not None and final is not None and not final < start


def best_point(entry) -> Point | None:
    """The run's lowest validation point (None for a run that logged none)."""
    return min(entry.curve, key=lambda p: p.val_loss, default=None)


def regressed(entry) -> bool:
    """Did the run get worse at its end: its final loss more than REGRESSED above its own best?
    As the target, that final loss would be reached by every other run at once."""
    best, final = best_point(entry), entry.summary["final_val_loss"]
    return best is not None and final is not None and not final <= best.val_loss * (1 + REGRESSED)


def default_target(entries: list) -> float | None:
    """The worst (highest) final validation loss of the runs that finished, did not diverge and did
    not get worse at their end: every one of them reaches it."""
    finals = [e.summary["final_val_loss"] for e in entries if isinstance(e, RecordedRun)
              and e.summary["final_val_loss"] is not None and math.isfinite(e.summary["final_val_loss"])
              and not diverged(e) and not regressed(e)]
    return max(finals) if finals else None


def row(entry, target: float | None, apart: list[str] | None = None, levels: bool = False) -> dict:
    """One table row; `apart`: how the run differs from the others (setup.not_comparable), if it does;
    `levels`: with each level's bytes and waits (a run of the report has replica groups)."""
    if isinstance(entry, Failed):
        return {"label": entry.label, "status": "failed", "error": entry.error}
    s, curve, best = entry.summary, entry.curve, best_point(entry)
    load, cores = load_of(s) or (None, None)
    to_time = reach(curve, target, "time_s") if target is not None else None
    to_bytes = reach(curve, target, "wire_bytes") if target is not None else None
    return (level_cells(entry) if levels else {}) | {
        "label": entry.label, "status": "ok", "strategy": s["strategy"], "path": str(entry.path),
        "group": entry.group or entry.label, "round": entry.round,
        "load": load, "cores": cores, "contention": contention(s), "timing": timing_dependent(s),
        "workers": s["workers"], "steps": s["steps"], "tokens": s["tokens"], "tokens_planned": setup_of(entry).tokens,
        "comparable": not apart, "not_comparable": apart or [], "wall_s": s["wall_s"],
        "final_val_loss": s["final_val_loss"], "diverged": diverged(entry), "starting_loss": starting_loss(entry),
        "regressed": regressed(entry), "best_val_loss": best.val_loss if best else None,
        "best_val_step": best.step if best else None,
        "time_to_target_s": to_time,
        "mb_to_target": to_bytes / 1e6 if to_bytes is not None else None,
        "tokens_per_s": s["tokens_per_s"],
        "wire_mb_per_rank_per_step": s["wire_bytes_per_rank_per_step"] / 1e6,
        "exposed_comm_pct": 100 * s["exposed_comm_fraction"],
        "optimizer_state_mb_per_rank": _scaled(s["optimizer_state_bytes_per_rank"], 1e6),
        "peak_mem_mib": _scaled(s["peak_mem_bytes"], 2**20),
        "exposed_s_per_outer_sync": exposed_per_outer_sync(entry),
        "finished": s.get("finished", True), "steps_planned": s.get("steps_planned", s["steps"]),
    }


def _scaled(value: float | None, unit: float) -> float | None:
    """A figure in `unit`s; None where the run did not record it (it did not finish)."""
    return None if value is None else value / unit


def markdown(rows: list[dict], target: float | None) -> str:
    columns = COLUMNS + (LEVEL_COLUMNS if any("cross_bytes_per_token" in r for r in rows) else []) + \
        ([OUTER_COLUMN] if any(r.get("exposed_s_per_outer_sync") is not None for r in rows) else [])
    head = ["strategy"] + [h for _, h, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            error = r["error"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['label']} | failed: {error} |" + " |" * (len(columns) - 1))
            continue
        cells = [fmt.format(r[k]) if r.get(k) is not None else MISSING.get(k, "-") for k, _, fmt in columns]
        mark = ("" if r["comparable"] else " †") + (TIMING_MARK if r.get("timing") else "")
        lines.append("| " + " | ".join([r["label"] + mark] + cells) + " |")
    note = (f"Target loss {target:.4f}" if target is not None else "No run finished, so no target loss") + \
        (": time and bytes when the validation loss first reached it (interpolated between validation "
         "points; time = summed step wall time, evaluation excluded)." if target is not None else ".")
    note += _load_note(rows)
    apart = [f"{r['label']}: {'; '.join(r['not_comparable'])}" for r in rows if not r.get("comparable", True)]
    if apart:
        note += "\n\n† Not comparable with the other runs (different model, data, tokens or workers): " + \
            ". ".join(apart) + "."
    timing: dict[str, list[str]] = {}
    for r in rows:
        if r.get("timing"):
            timing.setdefault(r["timing"], []).append(r["label"])
    if timing:
        note += "\n\n" + " ".join(f"‡ {', '.join(labels)}: its result moves with the timing, so with the load: "
                                   f"{why}." for why, labels in timing.items())
    return "\n".join(lines) + "\n\n" + note + "\n"


def _load_note(rows: list[dict]) -> str:
    """What the load column holds, with the cores it is measured against."""
    cores = sorted({r["cores"] for r in rows if r.get("cores")})
    if not cores:
        return ""
    return (f" Load at end: the 1-minute load average when the run ended, on {'/'.join(map(str, cores))} cores "
            f"(the run's own workers count in it); runs timed at different loads are compared in the answer only "
            f"where the load cannot explain their difference.")

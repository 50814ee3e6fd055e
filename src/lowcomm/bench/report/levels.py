"""Each run's traffic per level -- across replicas (the slow link) and inside them -- for the
report's table, answer and time plot. Shown only when a run of the report has replica groups
(--replicas R < W), so a report of flat runs reads as it always did; a flat run beside one
with replicas counts all its traffic as across (each worker is a replica of one process)."""
from __future__ import annotations

from ...metrics.levels import has_levels, level_figures
from ...metrics.runs import RecordedRun

TIE = 0.005  # bytes per token this close count as the same (a strategy's plan, not noise, sets them)
# (key, header, format) of the table's level columns, the figures users compare first.
COLUMNS = [
    ("cross_bytes_per_token", "B/token across replicas", "{:,.1f}"),
    ("cross_exposed_pct", "exposed % across", "{:.1f}"),
    ("intra_bytes_per_token", "B/token inside replicas", "{:,.1f}"),
    ("intra_exposed_pct", "exposed % inside", "{:.1f}"),
]


def leveled(run: RecordedRun) -> bool:
    return has_levels(run.summary)


def run_levels(run: RecordedRun) -> dict[str, tuple[float, float]]:
    """level -> (bytes per token, seconds a rank waited on it: mean over ranks). Runs that
    did not count levels (flat ones, or written before levels existed) sent everything across."""
    s = run.summary
    if leveled(run):
        return level_figures(s)
    waits = s["exposed_comm_s_per_rank"]
    return {"cross": (sum(r["wire_bytes"] for r in run.steps) / max(s["tokens"], 1), sum(waits) / len(waits)),
            "intra": (0.0, 0.0)}


def level_cells(run: RecordedRun) -> dict:
    """A table row's level columns (COLUMNS' keys), with the layout they were measured on."""
    s = run.summary
    cells = {"replicas": s.get("replicas", s["workers"])}
    for level, (per_token, waited) in run_levels(run).items():
        cells[f"{level}_bytes_per_token"] = per_token
        cells[f"{level}_exposed_pct"] = 100 * waited / s["wall_s"]
    return cells


def level_sentence(rows: list[dict]) -> str:
    """The answer's words on levels: each run's bytes per token and waits on either side, and
    which sends the fewest across, where the slow link is."""
    shown = [r for r in rows if "cross_bytes_per_token" in r]
    if not shown:
        return ""
    each = "; ".join(f"{r['label']} {r['cross_bytes_per_token']:,.1f} across replicas "
                     f"({r['cross_exposed_pct']:.0f}%), {r['intra_bytes_per_token']:,.1f} inside "
                     f"({r['intra_exposed_pct']:.0f}%)" for r in shown)
    text = f"By level (bytes per token trained, all ranks; share of the wall time waited, mean over ranks): {each}."
    least = min(r["cross_bytes_per_token"] for r in shown)
    fewest = [r["label"] for r in shown if r["cross_bytes_per_token"] <= least * (1 + TIE)]
    if len(fewest) < len(shown):  # when all send the same across, there is no one to name
        text += f" Fewest bytes across replicas: {', '.join(f'**{label}**' for label in fewest)}."
    return text

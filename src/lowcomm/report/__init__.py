"""`lowcomm report`: a comparison of runs as report.md, report.json and PNG plots."""
from __future__ import annotations

from pathlib import Path

from ..metrics.runlog import write_json_atomic
from .plots import PLOTS, write_plots
from .runs import Failed, Run, load_bench, load_entries, load_run
from .table import default_target, markdown, row

__all__ = ["PLOTS", "Failed", "Run", "load_bench", "load_entries", "load_run", "write_report"]


def write_report(entries: list, out: Path, target_loss: float | None = None, title: str = "lowcomm report",
                 preamble: str = "") -> list[dict]:
    """Write report.md, report.json and the plots for `entries` (Run or Failed) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    target = target_loss if target_loss is not None else default_target(entries)
    rows = [row(e, target) for e in entries]
    runs = [e for e in entries if isinstance(e, Run)]
    plots = write_plots(runs, out, target) if runs else []
    text = f"# {title}\n\n" + (preamble + "\n\n" if preamble else "") + markdown(rows, target)
    text += "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    (out / "report.md").write_text(text)
    write_json_atomic(out / "report.json", {"target_loss": target, "rows": rows})
    return rows

"""`lowcomm report`: a comparison of runs as report.md, report.json and PNG plots."""
from __future__ import annotations

from pathlib import Path

from ...metrics.runlog import write_json_atomic
from ..preflight import PLOTS_HINT, plots_available
from .answer import answer
from .levels import leveled
from .plots import PLOTS, write_plots
from ...metrics.runs import Failed, RecordedRun, load_bench, load_entries, load_run
from .setup import describe, not_comparable
from .slowed import causes, section
from .table import default_target, markdown, row
from .untrusted import section as untrusted_section

__all__ = ["PLOTS", "Failed", "RecordedRun", "load_bench", "load_entries", "load_run", "write_report"]


def write_report(entries: list, out: Path, target_loss: float | None = None, title: str = "lowcomm report",
                 preamble: str = "") -> list[dict]:
    """Write report.md (the answer, the table, what slowed each run, the plots), report.json and the plots for
    `entries` (RecordedRun or Failed) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    runs = [e for e in entries if isinstance(e, RecordedRun)]
    apart = not_comparable(runs)
    comparable = [r for r in runs if r.label not in apart]
    target = target_loss if target_loss is not None else default_target(comparable)
    levels = any(leveled(r) for r in runs)  # a flat report keeps its columns
    rows = [row(e, target, apart.get(e.label), levels) for e in entries]
    finished = [r for r in comparable if r.summary.get("finished", True)]  # they counted their parameters
    setting = describe((finished or comparable)[0]) if comparable else ""
    plots = plot_section(lambda: write_plots(runs, out, target, setting if not apart else "runs of different setups")
                         if runs else [])
    text = (f"# {title}\n\n" + answer(rows, target, setting) + "\n\n" + (preamble + "\n\n" if preamble else "")
            + markdown(rows, target) + section(runs) + untrusted_section(runs) + plots)
    (out / "report.md").write_text(text)
    write_json_atomic(out / "report.json", {"target_loss": target, "setting": setting, "rows": rows,
                                            "slowed": {r.label: causes(r) for r in runs}})
    return rows


def plot_section(draw) -> str:
    """report.md's plots: `draw()` writes them and returns their paths. Without the plots extra
    the report is still written, with one line saying what to install instead of the figures."""
    if not plots_available():
        return f"\nNo plots: matplotlib is not installed ({PLOTS_HINT}), then `lowcomm report` this directory.\n"
    return "".join(f"\n![{p.stem}]({p.name})\n" for p in draw())

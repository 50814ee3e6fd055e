"""`lowcomm report`: a comparison of run or bench directories."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from .flags import target_loss, target_loss_flag


def add_report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("dirs", nargs="+", metavar="RUNDIR", help="run or bench directories")
    report.add_argument("--out", metavar="DIR", help="where to write report.md and the plots (default: the bench "
                        "dir when given one bench, else runs/report-<time>)")
    target_loss_flag(report, "the worst run's final loss")


def run(args) -> int:
    from ..bench.report import write_report
    from ..storage.files import check_writable
    from ..metrics.runs import is_bench, load_bench, load_entries

    target = target_loss(args)
    entries = load_entries(args.dirs)
    # Not ./report: run inside a clone, that left a directory git did not ignore; runs/ is the outputs'.
    out = Path(args.out) if args.out else Path(args.dirs[0]) if len(args.dirs) == 1 and is_bench(
        Path(args.dirs[0])) else Path(f"runs/report-{time.strftime('%Y%m%d-%H%M%S')}")
    check_writable(out, "--out")
    recipe = load_bench(args.dirs[0]) if len(args.dirs) == 1 and is_bench(Path(args.dirs[0])) else None
    if recipe is not None and "recipe" in recipe.meta:  # its variants at their best settings, as the bench wrote
        from ..bench.report.recipe import write_recipe_report
        write_recipe_report(recipe, out, target)
    else:
        write_report(entries, out, target)
    print((out / "report.md").read_text().split("\n\n![")[0])
    print(f"\nreport: {out / 'report.md'} and plots in {out}/")
    return 0

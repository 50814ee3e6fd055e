"""Running a recipe: every run of its grid planned and validated, what the bench needs checked,
then each run in turn (a failure is recorded and the next one runs), then the report. The
recipe is copied into the bench (OUT/recipe.toml) and described in bench.json, so the bench
can be rerun and its report rebuilt (`lowcomm report OUT`) from what it holds."""
from __future__ import annotations

import sys

from .. import machine
from ..compare import _run_all, bench_dir
from ..preflight import preflight
from ..report.recipe import write_recipe_report
from ...metrics.runs import load_bench
from .grid import check_size, grid_size, plan_grid
from .read import Recipe

EXIT_MISSED_TARGET = 3  # --check-targets: a variant missed one (1 stays "a run failed")
# What `lowcomm bench RECIPE.toml` takes besides the recipe: the recipe alone says what runs,
# so that the bench can be repeated from it; a run flag is refused, not merged in silently.
SAY_CHECKING = 10  # more runs than this: a line at once that they are being checked (about a second each)
RECIPE_FLAGS = {"command", "recipe", "out", "overwrite", "quiet", "target_loss", "check_targets"}


def run_recipe(recipe: Recipe, out: str, target_loss: float | None, overwrite: bool, quiet: bool,
               check_targets: bool) -> int:
    out_dir = bench_dir(out or recipe.out, overwrite, f"bench-{recipe.path.stem}")
    if check_size(recipe) > SAY_CHECKING and not quiet:  # checking them takes a while: say so first
        print(f"lowcomm: checking the {grid_size(recipe):,} runs of {recipe.path} before the first starts",
              flush=True)
    planned = plan_grid(recipe, out_dir, overwrite)
    preflight([p.cfg for p in planned], out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "recipe.toml").write_text(recipe.text)
    meta = {"lowcomm_bench": 1, "recipe": describe(recipe), "strategies": sorted({v.strategy for v in recipe.variants}),
            "tokens": recipe.tokens, "target_loss": target_loss, "workers": planned[0].cfg.workers,
            "machine": machine.at_start([p.cfg for p in planned]), "runs": []}
    tuned = []
    try:
        _run_all(planned, meta, out_dir, quiet)
    finally:  # also when interrupted: the runs that finished are reported
        if meta["runs"]:
            tuned = write_recipe_report(load_bench(out_dir), out_dir, target_loss)
    print((out_dir / "report.md").read_text().split("\n## Every setting")[0].rstrip(), flush=True)
    print(f"\nbench: report, plots and runs in {out_dir}/", flush=True)
    failed = [r["label"] for r in meta["runs"] if r["status"] != "ok"]
    if failed:
        print(f"error: {len(failed)} of {len(meta['runs'])} runs failed ({', '.join(failed)}); the report shows the "
              f"others", file=sys.stderr, flush=True)
        return 1
    missed = [f"{r['label']} {t['target']}" for r in tuned for t in r["targets"] if not t["met"]]
    if missed and check_targets:
        print(f"error: {len(missed)} target(s) missed ({', '.join(missed)})", file=sys.stderr, flush=True)
        return EXIT_MISSED_TARGET
    return 0


def describe(recipe: Recipe) -> dict:
    """The recipe as bench.json keeps it: enough for the report without the file."""
    return {"path": str(recipe.path), "baseline": recipe.baseline, "seeds": recipe.seeds,
            "target_loss": recipe.target_loss, "description": recipe.description,
            "variants": [{"label": v.label, "strategy": v.strategy, "settings": v.settings, "sweep": v.sweep,
                          "targets": v.targets} for v in recipe.variants]}

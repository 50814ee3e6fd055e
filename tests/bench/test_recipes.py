"""`lowcomm bench RECIPE.toml`: a recipe is checked whole before anything runs (a bad one is
one `error:` line naming the key and the file, exit 2, nothing written); its grid runs each
variant at each swept value and seed; the report compares each variant at its own best
setting against the baseline, keeps the whole grid, and is rebuilt by `lowcomm report`.
The selection of the best setting is checked on runs written by hand (tests/helpers/fake_runs.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lowcomm.cli.main import main
from lowcomm.bench.report.recipe import write_recipe_report
from lowcomm.metrics.runs import load_bench
from fake_runs import fake_run

TINY = """workers = 2
n_layer = 1
n_head = 2
d_model = 32
seq_len = 32
micro_batch = 4
eval_batches = 2
steps = 3
link = "1gbit,1ms"
"""
RECIPE = TINY + """baseline = "ddp"
[sweep]
lr = [1e-3, 3e-3]
[[run]]
label = "ddp"
strategy = "ddp"
[[run]]
label = "int8+ef"
strategy = "quantized"
bits = 8
[run.targets]
min_bytes_reduction = 3.5
max_loss_gap = 0.5
min_speedup = 1000.0
"""


def write(tmp_path: Path, text: str, name: str = "recipe.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BAD = {  # case -> (recipe text, what its one error line must name)
    "unknown top-level key": (TINY + "lrr = 1\n[[run]]\nstrategy = \"ddp\"\n", ["'lrr'"]),
    "unknown strategy": ("[[run]]\nlabel = \"x\"\nstrategy = \"telepathy\"\n", ["'telepathy'", "[[run]] 'x'"]),
    "sweep of no key": ("[sweep]\nlearning_rate = [1, 2]\n[[run]]\nstrategy = \"ddp\"\n", ["'learning_rate'", "[sweep]"]),
    "sweep of no key in a run": ("[[run]]\nstrategy = \"diloco\"\n[run.sweep]\nsync_everyy = [8]\n", ["'sync_everyy'"]),
    "duplicate labels": ("[[run]]\nstrategy = \"ddp\"\n[[run]]\nstrategy = \"ddp\"\n", ["labelled 'ddp'"]),
    "option of another strategy": ("[[run]]\nstrategy = \"ddp\"\nbits = 8\n", ["bits", "[[run]] 'ddp'"]),
    "option no run has": ("bits = 8\n[[run]]\nstrategy = \"ddp\"\n", ["bits", "none of the runs"]),
    "sweep no run takes": ("[sweep]\nbits = [4, 8]\n[[run]]\nstrategy = \"ddp\"\n", ["bits", "none of the runs"]),
    "sweep not a list": ("[sweep]\nlr = 1e-3\n[[run]]\nstrategy = \"ddp\"\n", ["lr", "list"]),
    "seed swept": ("[sweep]\nseed = [1, 2]\n[[run]]\nstrategy = \"ddp\"\n", ["seed", "seeds"]),
    "unknown baseline": ("baseline = \"dp\"\n[[run]]\nstrategy = \"ddp\"\n", ["baseline 'dp'"]),
    "bad value": ("workers = 0\n[[run]]\nstrategy = \"ddp\"\n", ["workers", "[[run]] 'ddp'"]),
    "no runs": ("steps = 3\n", ["no [[run]]"]),
    "unknown target": ("[[run]]\nstrategy = \"ddp\"\n[run.targets]\nfastest = 1\n", ["'fastest'"]),
    "bad seeds": ("seeds = [0, -1]\n[[run]]\nstrategy = \"ddp\"\n", ["seeds"]),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_recipe_is_one_error_line_naming_the_key_and_the_file(case, tmp_path, capsys):
    text, names = BAD[case]
    recipe = write(tmp_path, text)
    assert main(["bench", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    for name in names + [str(recipe)]:
        assert name in err[0], (name, err[0])
    assert not (tmp_path / "out").exists()


def test_a_grid_of_many_runs_says_at_once_that_it_checks_them(tmp_path, capsys):
    """Each run is checked before the first starts (about a second each on a loaded machine):
    past ten the bench says so first, instead of sitting silent."""
    lrs = ", ".join(f"{(i + 1) * 1e-4:g}" for i in range(12))
    recipe = write(tmp_path, f"[sweep]\nlr = [{lrs}]\n[[run]]\nlabel = \"bad\"\nstrategy = \"ddp\"\nworkers = 0\n"
                             f"[[run]]\nstrategy = \"ddp\"\n")
    assert main(["bench", str(recipe), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == f"lowcomm: checking the 24 runs of {recipe} before the first starts"
    assert "workers" in captured.err and "[[run]] 'bad'" in captured.err
    assert not (tmp_path / "out").exists()


def test_run_flags_are_refused_with_a_recipe(tmp_path, capsys):
    recipe = write(tmp_path, RECIPE)
    for flags, name in ((["--lr", "1e-3"], "--lr"), (["--bits", "4"], "--bits"), (["--strategies", "ddp"], "--strategies")):
        assert main(["bench", str(recipe), *flags, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {name} does not apply with a recipe") and str(recipe) in err
    assert main(["bench", "--check-targets", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def recipe_bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    out = root / "out"
    code = main(["bench", str(write(root, RECIPE)), "--out", str(out), "--quiet", "--check-targets"])
    return out, code


def summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@pytest.mark.procs
def test_the_grid_runs_each_variant_at_each_value(recipe_bench):
    out, code = recipe_bench
    assert code == 3  # every run finished; int8+ef's min_speedup target is out of reach
    meta = json.loads((out / "bench.json").read_text())
    assert [(r["variant"], r["point"], r["status"]) for r in meta["runs"]] == [
        ("ddp", {"lr": 1e-3}, "ok"), ("ddp", {"lr": 3e-3}, "ok"),
        ("int8+ef", {"lr": 1e-3}, "ok"), ("int8+ef", {"lr": 3e-3}, "ok")]
    for r in meta["runs"]:
        config = (out / r["dir"] / "config.toml").read_text()
        assert f"lr = {r['point']['lr']}" in config and "seed = 0" in config
    assert "bits = 8" in (out / "int8+ef" / "lr=0.001" / "config.toml").read_text()
    assert (out / "recipe.toml").read_text() == RECIPE  # the bench can be run again from what it holds


@pytest.mark.procs
def test_report_compares_each_variant_at_its_best_lr_against_the_baseline(recipe_bench):
    out, _ = recipe_bench
    report = json.loads((out / "report.json").read_text())
    tuned = {r["label"]: r for r in report["tuned"]}
    best = {}
    for variant in ("ddp", "int8+ef"):
        losses = {lr: summary(out / variant / f"lr={lr:g}")["final_val_loss"] for lr in (1e-3, 3e-3)}
        best[variant] = min(losses, key=losses.get)
        assert tuned[variant]["best"] == {"lr": best[variant]}
        assert tuned[variant]["final_val_loss"] == losses[best[variant]]
    ddp, int8 = (summary(out / v / f"lr={best[v]:g}") for v in ("ddp", "int8+ef"))
    row = tuned["int8+ef"]
    assert row["loss_vs_baseline"] == pytest.approx(int8["final_val_loss"] / ddp["final_val_loss"] - 1)
    assert row["bytes_vs_baseline"] == pytest.approx(
        (int8["wire_bytes_total"] / int8["tokens"]) / (ddp["wire_bytes_total"] / ddp["tokens"]))
    assert row["speed_vs_baseline"] == pytest.approx(int8["tokens_per_s"] / ddp["tokens_per_s"])
    assert [(t["target"], t["met"]) for t in row["targets"]] == [
        ("min_bytes_reduction", True), ("max_loss_gap", True), ("min_speedup", False)]
    assert len(report["grid"]) == 4 and sum(c["best"] for c in report["grid"]) == 2
    assert len(report["rows"]) == 4
    text = (out / "report.md").read_text()
    answer = text.split("\n\n")[1]
    assert answer.startswith("**Answer.**") and "First to reach it:" in answer and "Fewest tokens to it:" in answer
    assert "| int8+ef | lr=" in text and "fewer)" in text and "**missed** tokens/s ×" in text
    assert "## Every setting tried" in text and "## Every run" in text
    for plot in ("loss_vs_lr.png", "loss_vs_time.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG" and f"({plot})" in text


@pytest.mark.procs
def test_report_rebuilds_the_recipe_report(recipe_bench, tmp_path):
    out, _ = recipe_bench
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert again["tuned"] == json.loads((out / "report.json").read_text())["tuned"]


def test_without_matplotlib_the_report_is_written_with_one_line_saying_what_to_install(tmp_path, monkeypatch):
    """A recipe bench's report rebuilt where `import matplotlib` fails (the bench written by hand)."""
    monkeypatch.undo()  # no_plots' stand-in: here the report finds out for itself
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as when not installed
    out = fake_bench(tmp_path / "bench", {("ddp", 1e-3): [(0, 3.0, 2)], ("int8+ef", 1e-3): [(0, 3.1, 2)]})
    assert main(["report", str(out), "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Every run" in text and "![" not in text
    assert [line for line in text.splitlines() if "matplotlib" in line] == [
        "No plots: matplotlib is not installed (pip install 'lowcomm[plots]'), then `lowcomm report` this directory."]


# -- the choice of the best setting, on runs written by hand -------------------------------------

def fake_bench(root: Path, cells: dict) -> Path:
    """cells: (variant, lr) -> [(seed, final loss, training seconds[, load at its end]) or (seed, None): failed]."""
    runs = []
    for (variant, lr), seeds in cells.items():
        for seed, *rest in seeds:
            where = f"{variant}/lr={lr:g},seed={seed}"
            record = {"label": f"{variant} lr={lr:g},seed={seed}", "dir": where + "/ddp", "strategy": "ddp",
                      "variant": variant, "point": {"lr": lr}, "seed": seed, "status": "ok", "error": None}
            if rest[0] is None:
                record.update(status="failed", error="boom")
            else:
                loss, secs, *load = rest
                fake_run(root / where, "ddp", [(secs / 2, 10e6, loss + 1), (secs, 20e6, loss)],
                         load=next(iter(load), None))
            runs.append(record)
    variants = list(dict.fromkeys(v for v, _ in cells))
    (root / "bench.json").write_text(json.dumps({"lowcomm_bench": 1, "runs": runs, "recipe": {
        "path": "r.toml", "baseline": variants[0], "seeds": [0, 1], "target_loss": None,
        "variants": [{"label": v, "strategy": "ddp", "settings": {}, "sweep": {}, "targets": {}} for v in variants]}}))
    return root


def tuned_of(root: Path) -> dict:
    rows = write_recipe_report(load_bench(root), root / "report")
    return {r["label"]: r for r in rows}


@pytest.fixture(autouse=True)
def no_plots(request, monkeypatch):
    if "recipe_bench" not in request.fixturenames:
        monkeypatch.setattr("lowcomm.bench.report.plots_available", lambda: False)


def test_the_best_setting_is_the_lowest_mean_loss_over_seeds_with_its_spread(tmp_path):
    root = fake_bench(tmp_path, {("a", 1e-3): [(0, 3.0, 2), (1, 3.2, 2)],   # mean 3.1, one lucky seed
                                 ("a", 2e-3): [(0, 3.04, 2), (1, 3.06, 2)],  # mean 3.05: chosen
                                 ("b", 1e-3): [(0, 3.3, 2), (1, 3.3, 2)]})
    a = tuned_of(root)["a"]
    assert a["best"] == {"lr": 2e-3} and a["final_val_loss"] == pytest.approx(3.05)
    assert (a["final_val_loss_min"], a["final_val_loss_max"]) == (3.04, 3.06)
    assert a["final_val_loss_sd"] == pytest.approx(0.0141421, rel=1e-4)
    assert a["loss_vs_baseline"] == 0 and tuned_of(root)["b"]["loss_vs_baseline"] == pytest.approx(3.3 / 3.05 - 1)
    grid = json.loads((root / "report" / "report.json").read_text())["grid"]
    assert [(c["variant"], c["point"]["lr"], c["best"], c["mean"]) for c in grid] == [
        ("a", 1e-3, False, pytest.approx(3.1)), ("a", 2e-3, True, pytest.approx(3.05)), ("b", 1e-3, True, 3.3)]
    assert "**3.0500 ± 0.0141**" in (root / "report" / "report.md").read_text()


def test_a_tie_in_loss_goes_to_the_shorter_time_and_failed_cells_are_not_chosen(tmp_path):
    root = fake_bench(tmp_path, {("a", 1e-3): [(0, 3.0, 4), (1, 3.0, 4)],
                                 ("a", 2e-3): [(0, 3.0, 2), (1, 3.0, 2)],   # as good, and faster
                                 ("a", 4e-3): [(0, None), (1, None)],        # both seeds failed
                                 ("b", 1e-3): [(0, None), (1, 3.5, 2)]})    # one seed of two
    tuned = tuned_of(root)
    assert tuned["a"]["best"] == {"lr": 2e-3}
    assert (tuned["b"]["seeds"], tuned["b"]["seeds_failed"]) == (1, 1)
    text = (root / "report" / "report.md").read_text()
    assert "| a | 3.0000 ± 0.0000 | **3.0000 ± 0.0000** | failed |" in text


def test_variants_timed_at_loads_that_differ_more_than_their_times_are_not_ranked_by_time(tmp_path):
    """b takes 1.5x a's time over both seeds but ran at 3x its load (contention 6 vs 2 on 2 cores)."""
    root = fake_bench(tmp_path, {("a", 1e-3): [(0, 3.0, 2, 4.0), (1, 3.0, 2, 4.0)],
                                 ("b", 1e-3): [(0, 3.0, 3, 12.0), (1, 3.0, 3, 12.0)]})
    tuned = tuned_of(root)
    assert (tuned["b"]["load"], tuned["b"]["contention"]) == (12.0, pytest.approx(6.0))
    answer = (root / "report" / "report.md").read_text().split("\n\n")[1]
    assert ("Not ranked by time, nor picked: b took 1.50x a's time to the target but ran under 3.00x its "
            "contention (load 12.0 on 2 cores against load 4.0 on 2 cores), so the load alone could make it "
            "faster.") in answer
    level = fake_bench(tmp_path / "level", {("a", 1e-3): [(0, 3.0, 2, 4.0), (1, 3.0, 2, 4.0)],
                                            ("b", 1e-3): [(0, 3.0, 3, 4.0), (1, 3.0, 3, 4.0)]})
    tuned_of(level)
    assert "First to reach it: **a**" in (level / "report" / "report.md").read_text()


@pytest.mark.parametrize("recipe", sorted((Path(__file__).parents[2] / "bench" / "recipes").glob("*.toml")),
                         ids=lambda p: p.name)
def test_the_shipped_recipes_read_and_plan(recipe, tmp_path):
    """Every recipe under bench/recipes/ still reads and validates, run by run, as the code changes."""
    from lowcomm.bench.recipe import load_recipe
    from lowcomm.bench.recipe.grid import plan_grid
    planned = plan_grid(load_recipe(recipe), tmp_path / "out", overwrite=False)
    assert planned and not (tmp_path / "out").exists()

"""`lowcomm bench --repeats N`: every strategy N times in interleaved rounds whose order
alternates, each run in OUT/<strategy>/r<i>/, and one answer per strategy. The runs are
written by hand in place of training (no worker starts), so the order is what is checked."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import lowcomm.launch.launcher as launcher
from lowcomm.cli.main import main
from lowcomm.errors import RunError
from fake_runs import fake_run

TINY = ["--workers", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "32",
        "--micro-batch", "4", "--steps", "2", "--quiet"]
SECONDS = {"ddp": 10.0, "zero1": 10.2, "diloco": 18.0}  # each strategy's time to its last validation


@pytest.fixture
def launched(monkeypatch) -> list[str]:
    """Replace training by a finished run written where the bench asked; the runs' dirs in order."""
    order = []

    def launch(cfg, out, quiet=False):
        run, seconds = Path(cfg.out), SECONDS[cfg.strategy]
        fake_run(run.parent, cfg.strategy, [(seconds / 2, 100e6, 4.0), (seconds, 200e6, 3.0)], load=2.0, name=run.name)
        order.append(str(run))

    monkeypatch.setattr("lowcomm.launch.launcher.launch", launch)
    monkeypatch.setattr("lowcomm.bench.report.write_plots", lambda *a: [])
    return order


def test_repeats_interleave_the_strategies_in_alternating_rounds(tmp_path, launched, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--strategies", "ddp,zero1,diloco", "--repeats", "3", *TINY, "--out", str(out)]) == 0
    rounds = ["ddp", "zero1", "diloco"], ["diloco", "zero1", "ddp"], ["ddp", "zero1", "diloco"]
    assert launched == [str(out / s / f"r{i}") for i, names in enumerate(rounds, 1) for s in names]
    meta = json.loads((out / "bench.json").read_text())
    assert meta["repeats"] == 3
    assert [(r["label"], r["dir"], r["group"], r["round"]) for r in meta["runs"][:4]] == [
        ("ddp r1", "ddp/r1", "ddp", 1), ("zero1 r1", "zero1/r1", "zero1", 1), ("diloco r1", "diloco/r1", "diloco", 1),
        ("diloco r2", "diloco/r2", "diloco", 2)]
    report = (out / "report.md").read_text()
    assert "3 strategies in 3 interleaved rounds (each round in the other order) on 2 workers" in report
    answer = report.split("\n\n")[1]
    assert "First to reach it: **ddp** (10.0 s, median of 3 rounds; next zero1, 10.2 s, median of 3 rounds)." in answer
    assert not any(f" r{i}" in answer for i in (1, 2, 3))  # it names strategies, not their runs
    assert "| ddp r1 |" in report and "| diloco r3 |" in report  # the table: every run


def test_a_strategy_with_a_failed_round_is_compared_on_the_rounds_it_finished(tmp_path, launched, monkeypatch):
    write = launcher.launch  # the fixture's: writes a finished run

    def fail_zero1_r2(cfg, out, quiet=False):
        if cfg.out.endswith(str(Path("zero1") / "r2")):
            raise RunError("worker rank 0 failed")
        write(cfg, out, quiet)

    monkeypatch.setattr("lowcomm.launch.launcher.launch", fail_zero1_r2)
    out = tmp_path / "b"
    assert main(["bench", "--strategies", "ddp,zero1", "--repeats", "2", *TINY, "--out", str(out)]) == 1
    answer = (out / "report.md").read_text().split("\n\n")[1]
    assert "First to reach it: **ddp** (10.0 s, median of 2 rounds; next zero1, 10.2 s)." in answer
    assert "Failed, so left out: zero1 r2" in answer


def test_without_repeats_each_strategy_runs_once_in_its_own_dir(tmp_path, launched):
    out = tmp_path / "b"
    assert main(["bench", "--strategies", "ddp,zero1", *TINY, "--out", str(out)]) == 0
    assert launched == [str(out / "ddp"), str(out / "zero1")]
    assert [r["label"] for r in json.loads((out / "bench.json").read_text())["runs"]] == ["ddp", "zero1"]


@pytest.mark.parametrize("value, message", [
    ("0", "error: --repeats 0 must be at least 1 (1: each strategy once)"),
    ("two", "error: --repeats must be an integer, got 'two'")])
def test_a_bad_repeat_count_is_refused_in_one_line(tmp_path, launched, capsys, value, message):
    assert main(["bench", "--repeats", value, *TINY, "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "b").exists() and launched == []

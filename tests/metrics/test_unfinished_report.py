"""`lowcomm report` on a run that did not finish (no summary.json): it shows what steps.jsonl and
config.toml hold -- the loss curve, the scored rounds, who was left out -- says in one line that
the run did not finish, and marks what only summary.json measures as unknown; a directory with
neither summary.json nor steps.jsonl is still refused in one line.

One real run is stopped with --stop-at (no summary.json, as when killed), then its steps.jsonl is
cut mid-line, as a kill while the record was being written leaves it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm.cli.main import main
from tiny_runs import TINY

STEPS, STOP, H = 12, 9, 3


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    from tiny_runs import TEXT
    root = tmp_path_factory.mktemp("unfinished")
    (root / "text.txt").write_text(TEXT)
    out = root / "run"
    assert main(["train", "--strategy", "diloco", *TINY, "--steps", str(STEPS), "--stop-at", str(STOP),
                 "--sync-every", str(H), "--eval-every", "4", "--score", "--score-patience", "1",
                 "--score-batches", "2", "--attack", "scale:-100", "--attackers", "1", "--data", str(root / "text.txt"),
                 "--out", str(out)]) == 0
    assert not (out / "summary.json").exists() and (out / "config.toml").is_file()
    with open(out / "steps.jsonl", "a") as f:
        f.write('{"step": 10, "loss": 3.1, "tok')  # the record a kill cut short
    return out


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()[:-1]]


@pytest.mark.procs
def test_the_report_of_a_stopped_run_shows_its_rounds_and_says_it_did_not_finish(stopped, tmp_path, capsys):
    capsys.readouterr()
    assert main(["report", str(stopped), "--out", str(tmp_path / "report")]) == 0
    shown = capsys.readouterr().out
    steps = logged(stopped)
    assert [r["step"] for r in steps] == list(range(1, STOP + 1))
    val = [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
    best_step, best = min(val, key=lambda p: p[1])
    said = [line for line in shown.splitlines() if "Did not finish (no summary.json" in line]
    assert len(said) == 1 and f"diloco (to step {STOP} of {STEPS}, best validation loss {best:.4f} at step " \
        f"{best_step})" in said[0], shown
    rounds = [k for r in steps for k in r.get("score_rounds", ())]
    assert [k["round"] for k in rounds] == list(range(STOP // H))
    for k in rounds:  # each round's scores, who was left out and what was named, as steps.jsonl has them
        cells = [f"{s:+.4f}" + (" **out**" if w in k["left_out"] else "") for w, s in enumerate(k["scores"])]
        assert f"| {k['round']} | " + " | ".join(cells) + f" | {'; '.join(k['events'])} |" in shown
    assert any(k["left_out"] == [1] for k in rounds), rounds  # scale:-100 left out (patience 1)
    assert "Emulated attack scale:-100 by worker(s) 1." in shown
    row, = json.loads((tmp_path / "report" / "report.json").read_text())["rows"]
    assert row["finished"] is False and row["steps"] == STOP and row["steps_planned"] == STEPS
    assert row["tokens"] == sum(r["tokens"] for r in steps) and row["wall_s"] == sum(r["wall_s"] for r in steps)
    assert row["wire_mb_per_rank_per_step"] == pytest.approx(sum(r["wire_bytes"] for r in steps) / STOP / 2 / 1e6)
    assert (row["best_val_loss"], row["best_val_step"]) == (best, best_step)
    assert [row[k] for k in ("final_val_loss", "tokens_per_s", "optimizer_state_mb_per_rank", "peak_mem_mib")] \
        == [None] * 4  # only the run's end measures them
    table = next(line for line in shown.splitlines() if line.startswith("| diloco |"))
    assert table.startswith(f"| diloco | - | {row['tokens']:,} |")


def test_a_directory_with_neither_summary_nor_steps_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "config.toml").write_text('strategy = "diloco"\n')
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: '{tmp_path}' is not a lowcomm run or bench (no summary.json, steps.jsonl or bench.json)"]
    (tmp_path / "steps.jsonl").write_text("")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: '{tmp_path}' did not finish and logged no step (no summary.json, steps.jsonl empty): "
        f"nothing to report"]
    assert not (tmp_path / "r").exists()

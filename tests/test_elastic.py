"""--elastic as a user meets it: a worker SIGKILLed mid-run is dropped by the survivors within
about 2 s and they finish the run; restarted, it rejoins at a commit point with the live state
bit-identical to its peers'; no step is logged (applied) twice; every live worker ends with the
same parameters (by hash). Strategies that cannot run elastically are refused in one line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli import main  # noqa: E402

TINY = ["--workers", "3", "--elastic", "--min-workers", "2", "--n-layer", "2", "--n-head", "2",
        "--d-model", "16", "--seq-len", "16", "--data", "pydoc", "--eval-every", "0", "--quiet"]


def train(out: Path, *flags: str, kill: str, log: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOWCOMM_TEST_KILL_AT": kill, "LOWCOMM_TEST_KILL_LOG": str(log)}
    return subprocess.run([sys.executable, "-m", "lowcomm", "train", *TINY, *flags, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_finished(out: Path, steps: int) -> tuple[list[dict], dict]:
    records = jsonl(out / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))  # each step once: none applied twice
    summary = json.loads((out / "summary.json").read_text())
    hashes = summary["elastic"]["final_params_sha256"]
    assert len(set(hashes)) == 1, hashes  # every live worker ends with the same parameters
    return records, summary


def test_diloco_survivors_drop_a_killed_worker_within_2s_and_finish(tmp_path):
    out, log = tmp_path / "run", tmp_path / "killed"
    done = train(out, "--strategy", "diloco", "--sync-every", "4", "--steps", "24", kill="1:6", log=log)
    assert done.returncode == 0, done.stderr
    assert "worker 1 failed: killed by signal SIGKILL; the others go on without it" in done.stderr
    records, summary = check_finished(out, 24)
    quorums = jsonl(out / "membership.jsonl")
    assert [q["slots"] for q in quorums] == [[0, 1, 2], [0, 2]]
    assert quorums[1]["step"] == 4  # the round in which it died (steps 5-8) was discarded and redone
    took = quorums[1]["time"] - float(log.read_text())
    assert took < 2.5, f"the survivors re-formed {took:.2f} s after the kill"
    assert records[3]["members"] == [0, 1, 2] and records[4]["members"] == [0, 2]
    # each outer sync records its contributors (token-weighted merge): three, then the two survivors
    assert [r["outer"]["contributors"] for r in records if "outer" in r] == [3, 2, 2, 2, 2, 2]
    assert summary["elastic"]["members"] == [0, 2]


def test_ddp_a_restarted_worker_rejoins_with_the_live_state(tmp_path):
    out, log = tmp_path / "run", tmp_path / "killed"
    done = train(out, "--strategy", "ddp", "--steps", "16", "--max-restarts", "1", kill="1:5", log=log)
    assert done.returncode == 0, done.stderr
    assert "restarting it (1 of 1)" in done.stderr
    _, summary = check_finished(out, 16)
    quorums = jsonl(out / "membership.jsonl")
    join = next(q for q in quorums if 1 in q["healed"])
    assert join["slots"] == [0, 1, 2] and join["step"] == 4
    # The joiner's state (parameters and optimizer state) equals its peers' when it starts training.
    assert len(set(join["state_sha256"])) == 1, join
    assert summary["elastic"]["members"] == [0, 1, 2]


@pytest.mark.parametrize("strategy", ["zero1", "acco", "streaming_diloco", "quantized"])
def test_strategies_that_cannot_run_elastically_are_refused_in_one_line(strategy, capsys, tmp_path):
    assert main(["train", "--strategy", strategy, *TINY, "--steps", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --elastic does not run strategy '{strategy}': ") and "\n" not in err, err
    assert not (tmp_path / "r").exists()


def test_min_workers_needs_elastic(capsys):
    assert main(["train", "--min-workers", "2", "--steps", "2", "--data", "pydoc"]) == 2
    assert "--min-workers applies only with --elastic" in capsys.readouterr().err

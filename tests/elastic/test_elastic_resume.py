"""Checkpoints and --resume of an elastic run: checkpoints are written at commit points by the
members of the time; `lowcomm train --resume` continues the run bit for bit with as many workers
as wrote the checkpoint, and with the workers it is started with otherwise (here 3 after 2,
stopped again with --stop-at), for ddp, zero1 (its shards put together and cut anew) and
sparseloco (a worker's own residual: the third worker's starts at zero)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli.main import main  # noqa: E402
from elastic_runs import TINY, check_finished, jsonl  # noqa: E402

pytestmark = pytest.mark.elastic

STEPS = 12


def lowcomm(capfd, *args: str) -> tuple[str, str]:
    """The command in this process (its launcher's imports done once: the workers' fork server
    stays warm across the three launches); the launcher's (stdout, stderr)."""
    assert main(list(args)) == 0, capfd.readouterr().err
    return capfd.readouterr()


def stopped_after_4(run: Path, copy: Path) -> Path:
    """A copy of `run` as a run stopped after step 4 would have left it."""
    shutil.copytree(run, copy)
    for later in ("ckpt-000008", "ckpt-000012"):
        shutil.rmtree(copy / later)
    (copy / "summary.json").unlink()
    return copy


def whole_state_hash(checkpoint: Path, strategy: str) -> str:
    """The hash of the state every member must hold, read from a checkpoint's files here: zero1's
    moments and master copy joined from the ranks' shards in rank order (cut to the model's size)."""
    from lowcomm.checkpoint import read, read_state
    from lowcomm.elastic.transfer import state_hash
    from lowcomm.strategies.registry import get

    found = read(checkpoint)
    states = [read_state(found, r)["strategy"] for r in range(found.world)]
    state = states[0]
    if strategy == "zero1":
        numel = sum(v.numel() for k, v in state["model"].items())
        (osd,) = state["optimizers"]
        for k, v in osd["state"][0].items():
            if getattr(v, "dim", lambda: 0)() == 1:
                v.data = torch.cat([st["optimizers"][0]["state"][0][k] for st in states])[:numel]
        if state["extra"]["master"] is not None:
            state["extra"]["master"] = torch.cat([st["extra"]["master"] for st in states])[:numel]
        state["extra"].pop("grads", None)
    return state_hash(get(strategy).replicated_state(state))


@pytest.mark.parametrize("flags", [["ddp"], ["zero1"], ["sparseloco", "--sync-every", "4"]],
                         ids=["ddp", "zero1", "sparseloco"])
def test_an_elastic_run_resumes_bit_for_bit_and_with_the_workers_it_finds(flags, tmp_path, capfd, monkeypatch):
    # sparseloco: each worker's error-feedback residual is its own; the third worker starts it at zero
    strategy = flags[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    whole = tmp_path / "whole"
    lowcomm(capfd, "train", *TINY, "--workers", "2", "--strategy", *flags, "--steps", str(STEPS), "--checkpoint-every", "4",
            "--keep", "3", "--out", str(whole))
    assert sorted(p.name for p in whole.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000008", "ckpt-000012"]
    assert json.loads((whole / "ckpt-000008" / "manifest.json").read_text())["world"] == 2
    _, uninterrupted = check_finished(whole, STEPS)

    # The same number of workers: the same parameters as the run that never stopped.
    resumed = stopped_after_4(whole, tmp_path / "resumed")
    lowcomm(capfd, "train", "--resume", str(resumed), "--quiet")
    _, summary = check_finished(resumed, STEPS)  # steps 1-12, each once
    assert summary["elastic"]["final_params_sha256"] == uninterrupted["elastic"]["final_params_sha256"]
    assert [q["step"] for q in jsonl(resumed / "membership.jsonl")] == [0, 4]

    # Three workers: the run goes on with them from step 4, and stops at 8 with their checkpoint.
    more = stopped_after_4(whole, tmp_path / "more")
    # (the launcher's lines only: the workers print to where the fork server was started, an
    # earlier test's capture when one started it)
    _, err = lowcomm(capfd, "train", "--resume", str(more), "--workers", "3", "--stop-at", "8")
    assert "written by 2 workers, resuming on 3" in err
    join = jsonl(more / "membership.jsonl")[-1]
    assert join["step"] == 4 and join["slots"] == [0, 1, 2] and len(set(join["state_sha256"])) == 1
    # every member resumed from the state the two workers saved (zero1's: two shards, cut in three)
    assert set(join["resumed_sha256"]) == {whole_state_hash(whole / "ckpt-000004", strategy)}, join
    assert [r["members"] for r in jsonl(more / "steps.jsonl")] == [[0, 1]] * 4 + [[0, 1, 2]] * 4  # to 8 only
    assert json.loads((more / "ckpt-000008" / "manifest.json").read_text())["world"] == 3
    assert not (more / "summary.json").exists()  # a part of the run: the part that reaches --steps writes it

"""`--wandb PROJECT`: rank 0 logs the same scalars as --tensorboard (metrics/scalars.py) to a
Weights & Biases run; without the optional package the flag is refused (exit 2) before anything
starts. wandb itself is too heavy for the test install: a stand-in module on the import path (which
the workers take from the launcher) records the calls lowcomm makes (init, log, finish), checked
against steps.jsonl."""
from __future__ import annotations

import json
import sys

import pytest

from tiny_runs import TINY, error_line

from lowcomm.cli.main import main
from lowcomm.metrics.scalars import step_scalars

STAND_IN = '''
import json, os

def _record(call, **fields):
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(json.dumps({"call": call, "pid": os.getpid(), **fields}) + "\\n")

class Run:
    def log(self, data, step=None):
        _record("log", data=data, step=step)

    def finish(self):
        _record("finish")

def init(**kwargs):
    _record("init", kwargs=kwargs)
    return Run()
'''


@pytest.mark.procs
def test_scalars_go_to_one_wandb_run_as_to_tensorboard(tmp_path, data_file, monkeypatch):
    (tmp_path / "fake" / "wandb").mkdir(parents=True)
    (tmp_path / "fake" / "wandb" / "__init__.py").write_text(STAND_IN)
    calls, out = tmp_path / "calls.jsonl", tmp_path / "run"
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    try:
        assert main(["train", *TINY, "--steps", "4", "--eval-every", "2", "--data", str(data_file),
                     "--out", str(out), "--wandb", "my-project"]) == 0
    finally:
        sys.modules.pop("wandb", None)  # the launcher imported the stand-in, checking for the package
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [c["call"] for c in made] == ["init"] + ["log"] * 4 + ["finish"]
    assert len({c["pid"] for c in made}) == 1  # rank 0 alone
    init = made[0]["kwargs"]
    assert init["project"] == "my-project" and init["name"] == out.name and init["dir"] == str(out)
    assert init["config"]["strategy"] == "ddp" and init["config"]["wandb"] == "my-project"
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    logs = made[1:-1]
    assert [c["step"] for c in logs] == [r["step"] for r in records] == [1, 2, 3, 4]
    for log, record in zip(logs, records):
        level = {k: v for k, v in log["data"].items() if k.endswith("rank0_bytes_total")}
        assert {k: v for k, v in log["data"].items() if k not in level} == pytest.approx(step_scalars(record))
        assert list(level) == ["comm/cross/rank0_bytes_total"]  # --log-every 1: every step ends a gather
    assert "train/val_loss" in logs[1]["data"] and "train/val_loss" not in logs[0]["data"]
    assert logs[-1]["data"]["comm/cross/rank0_bytes_total"] == sum(r["wire_bytes"] for r in records) / 2


@pytest.mark.parametrize("project, missing_package", [("my-project", True), ("team/project", False)])
def test_without_the_package_or_with_a_bad_project_the_flag_exits_2(tmp_path, data_file, monkeypatch, capfd,
                                                                    project, missing_package):
    if missing_package:
        monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    else:
        monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))  # installed: the name is what is wrong
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--data", str(data_file), "--out", str(out),
                 "--wandb", project]) == 2
    line = error_line(capfd.readouterr().err)
    if missing_package:
        assert line == ("error: --wandb needs the wandb package, which is not installed: "
                        "pip install 'lowcomm[wandb]' (or: pip install wandb)"), line
    else:
        assert line == "error: --wandb team/project: a W&B project name cannot contain /", line
    assert not out.exists()

"""A strategy is one file: registering it is all it takes to get a CLI flag, a `--help`
line, a TOML table and validation; deleting its file removes all of them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch

import lowcomm
from lowcomm.models.layout import ModelLayout
from lowcomm import config as C
from lowcomm.cli.main import build_parser, config_from_args
from lowcomm.run.driver import make_run
from lowcomm.strategies import available, get, option, register
from lowcomm.engines.flat import ShardedOptions
from lowcomm.contract.options import cli_flag
from lowcomm.contract.plan import PlannedOp
from lowcomm.strategies.registry import unregister
from lowcomm.strategies.zero1 import Zero1


@dataclass
class ToyOptions(ShardedOptions):
    toy_shrink: float = option(1.0, "toy: multiply every step's gradient by this", min=0)


class ToyShrunkZero1(Zero1):
    """ZeRO-1 whose averaged gradient is scaled by --toy-shrink (a strategy defined in a test)."""
    Options = ToyOptions

    def update(self, ctx):
        self.flat.grads.mul_(self.options.toy_shrink)
        super().update(ctx)



@pytest.fixture
def toy():
    register("toy")(ToyShrunkZero1)
    try:
        yield "toy"
    finally:
        unregister("toy")


def test_a_registered_strategy_gets_flag_help_toml_and_checks(toy, tmp_path):
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    help_text = train.format_help()
    assert "--toy-shrink" in help_text and "toy: multiply every step's gradient" in help_text
    assert f"one of: {', '.join(available())}" in " ".join(help_text.split())  # listed among the strategies

    # the CLI flag sets the chosen strategy's option
    cfg = config_from_args(parser.parse_args(["train", "--strategy", "toy", "--toy-shrink", "0.5"]))
    C.validate(cfg)
    assert cfg.strategy_options().toy_shrink == 0.5
    # the TOML table [toy], and the resolved config.toml writes it back
    f = tmp_path / "run.toml"
    f.write_text('strategy = "toy"\n[toy]\ntoy_shrink = 0.25\n')
    cfg = C.load_toml(f)
    C.validate(cfg)
    assert cfg.strategy_options().toy_shrink == 0.25
    assert "toy_shrink = 0.25" in C.to_toml(cfg).split("[toy]")[1]
    # validation from the declared bound, one line naming the value
    cfg = config_from_args(parser.parse_args(["train", "--strategy", "toy", "--toy-shrink", "-1"]))
    with pytest.raises(C.UsageError, match=r"--toy-shrink \(toy.toy_shrink\) must be at least 0, got -1"):
        C.validate(cfg)
    # the Python API takes it as a keyword, with the same default
    torch.manual_seed(0)
    strategy = make_run("toy", torch.nn.Linear(3, 1), lowcomm.Comm(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert strategy.options.toy_shrink == 1.0
    with pytest.raises(C.UsageError, match="unknown option 'shrink' for strategy 'toy'"):
        make_run("toy", torch.nn.Linear(3, 1), lowcomm.Comm(), lambda p: torch.optim.SGD(p, lr=0.1), shrink=2)


def test_the_toy_strategy_trains_with_its_option(toy):
    """The option really reaches the algorithm: shrink 0 freezes the model, 1 trains it."""
    def run(shrink):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        s = make_run("toy", model, lowcomm.Comm(), lambda p: torch.optim.SGD(p, lr=0.1), toy_shrink=shrink)
        x = torch.randn(8, 3)
        for _ in range(3):
            s.step(lambda: (x, x.sum(1, keepdim=True)), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
        s.close()
        return float((torch.nn.utils.parameters_to_vector(model.parameters()).detach() - start).norm())
    assert run(0.0) == 0.0 and run(1.0) > 0


@pytest.mark.procs
def test_deleting_a_strategy_file_removes_it_everywhere(tmp_path):
    """Copy the package, delete strategies/dpu.py: lowcomm still runs, with no dpu left in --help."""
    src = Path(lowcomm.__file__).parent
    shutil.copytree(src, tmp_path / "lowcomm", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "lowcomm" / "strategies" / "dpu.py").unlink()
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    helped = subprocess.run([sys.executable, "-m", "lowcomm", "train", "--help"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "--dpu-warmup" not in helped.stdout and "dpu" not in helped.stdout
    assert "--max-accum" in helped.stdout  # the others are all there
    refused = subprocess.run([sys.executable, "-m", "lowcomm", "train", "--strategy", "dpu"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    others = ", ".join(name for name in available() if name != "dpu")
    assert refused.stderr.strip().splitlines() == [f"error: unknown strategy 'dpu' (choose from: {others})"]


def test_old_spellings_keep_working(tmp_path):
    """Flags and TOML keys from before options moved into the strategies."""
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["train", "--strategy", "acco", "--max-accum", "8", "--deterministic"]))
    C.validate(cfg)
    assert (cfg.strategy_options().max_accum, cfg.strategy_options().deterministic) == (8, True)
    f = tmp_path / "old.toml"
    f.write_text('strategy = "zero1"\nparam_dtype = "bf16"\n')
    cfg = C.load_toml(f)
    C.validate(cfg)
    assert cfg.strategy_options().param_dtype == "bf16"
    cfg = config_from_args(parser.parse_args(["train", "--strategy", "dpu", "--dpu-warmup", "4", "--bucket-mb", "1"]))
    with pytest.raises(C.UsageError, match="--bucket-mb does not apply to strategy 'dpu'"):
        C.validate(cfg)


def test_docs_document_every_strategy_option():
    root = Path(__file__).parents[2]
    readme, page = (root / "README.md").read_text(), (root / "docs" / "strategies.md").read_text()
    for name in available():
        assert f"`{name}`" in readme, f"README's strategy table does not list {name}"
        for f in fields(get(name).Options):
            assert cli_flag(f) in page, f"docs/strategies.md does not document {cli_flag(f)} of {name}"


def test_comm_plan_is_declared_by_every_strategy():
    for name in available():
        cls = get(name)
        plan = cls.comm_plan(ModelLayout(((1000,),)), 4, cls.Options())
        assert plan and all(isinstance(op, PlannedOp) and op.nbytes > 0 for op in plan), name


def recipe_block() -> str:
    """The whole example strategy of docs/writing-a-strategy.md (its one python block)."""
    page = (Path(__file__).parents[2] / "docs" / "writing-a-strategy.md").read_text()
    return page.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.procs
def test_the_documented_example_strategy_runs_under_the_cli_the_planner_and_the_contract(tmp_path):
    """The docs' example, saved as a strategy file, trains at W=2 through the CLI sending exactly
    its plan, is priced by `lowcomm plan`, and refuses a bad value of its option in one line."""
    src = Path(lowcomm.__file__).parent
    shutil.copytree(src, tmp_path / "lowcomm", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "lowcomm" / "strategies" / "signsgd_vote.py").write_text(recipe_block())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    text = tmp_path / "text.txt"
    text.write_text("The quality of mercy is not strained; it droppeth as the gentle rain from heaven.\n" * 60)

    def lowcomm_cli(*args):
        return subprocess.run([sys.executable, "-m", "lowcomm", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    out = tmp_path / "run"
    trained = lowcomm_cli("train", "--strategy", "signsgd_vote", "--workers", "2", "--steps", "4", "--accum", "2",
                          "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
                          "--micro-batch", "2", "--eval-batches", "1", "--lr", "1e-3", "--vote-decay", "0.1",
                          "--data", str(text), "--out", str(out), "--quiet")
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["wire_bytes_total"] == summary["planned_wire_bytes_total"] > 0

    planned = lowcomm_cli("plan", "--params", "1e6", "--workers", "4", "--link", "1gbit,1ms",
                          "--worker-tflops", "10", "--strategies", "ddp,signsgd_vote")
    assert planned.returncode == 0, planned.stderr
    assert "signsgd_vote" in planned.stdout

    refused = lowcomm_cli("train", "--strategy", "signsgd_vote", "--vote-decay", "-1", "--out", str(tmp_path / "no"))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "--vote-decay" in refused.stderr and not (tmp_path / "no").exists()

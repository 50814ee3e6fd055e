"""FSDP inside replica groups (--inside fsdp), as a user runs it.

At (R, K) = (2, 2) FSDP inside a replica computes what ddp inside computes: ddp (HSDP) and
diloco end on the same parameters (within 1e-5; a rank's checkpoint holds its shard of every
tensor, torch.chunk's rows), every byte FSDP sends goes through the replica's Comm and equals
the plan at both levels, the optimizer state per rank is 1/K of a flat run's, a run stopped
and resumed ends where the uninterrupted one does, and a strategy that does not run on shards
is refused in one line. Seven tiny CLI runs (W <= 4, 4 steps).
"""
from __future__ import annotations

import json

import pytest
import torch
from dist_utils import rel_err

from lowcomm.checkpoint import read, read_state
from lowcomm.cli import main

STEPS, K = 4, 2
TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 80
EXTRA = {"ddp": [], "diloco": ["--sync-every", "2", "--sync-by", "steps"]}


def _argv(data, out, strategy, inside, workers=4, replicas=2, micro=2, *more):
    return ["train", "--strategy", strategy, "--workers", str(workers), "--replicas", str(replicas),
            "--inside", inside, "--micro-batch", str(micro), "--steps", str(STEPS), "--n-layer", "2",
            "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1",
            "--data", str(data), "--out", str(out), "--quiet", "--checkpoint-every", str(STEPS),
            *EXTRA[strategy], *more]


def _model(out, rank):
    return read_state(read(sorted(out.glob("ckpt-*"))[-1]), rank)["strategy"]["model"]


def _flat(model):
    return torch.cat([model[k].detach().reshape(-1).float() for k in sorted(model)])


def _whole(out, replica):
    """The replica's parameters: each tensor's shards (dim 0, rank order) put back together."""
    shards = [_model(out, replica * K + p) for p in range(K)]
    return _flat({k: torch.cat([s[k] for s in shards]) for k in shards[0]})


def _summary(out):
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    data = root / "text.txt"
    data.write_text(TEXT)
    for strategy in EXTRA:
        for inside in ("ddp", "fsdp"):
            assert main(_argv(data, root / f"{strategy}-{inside}", strategy, inside)) == 0
    # the flat reference: R single-process workers at K times the micro-batch
    assert main(_argv(data, root / "ddp-flat", "ddp", "ddp", 2, 2, 2 * K)) == 0
    # diloco stopped mid-period at step 3 (after its step-2 sync), then resumed to the end
    stopped = root / "diloco-resumed"
    assert main(_argv(data, stopped, "diloco", "fsdp", 4, 2, 2, "--checkpoint-every", "3", "--stop-at", "3")) == 0
    assert main(["train", "--resume", str(stopped), "--quiet"]) == 0
    return root


@pytest.mark.procs
@pytest.mark.parametrize("strategy", list(EXTRA))
def test_fsdp_inside_equals_ddp_inside(runs, strategy):
    fsdp, ddp = runs / f"{strategy}-fsdp", runs / f"{strategy}-ddp"
    for replica in range(2):
        assert rel_err(_whole(fsdp, replica), _flat(_model(ddp, replica * K))) <= 1e-5, (strategy, replica)
    assert _summary(fsdp)["tokens"] == _summary(ddp)["tokens"]


@pytest.mark.procs
@pytest.mark.parametrize("strategy", list(EXTRA))
def test_bytes_per_level_equal_the_plan(runs, strategy):
    summary = _summary(runs / f"{strategy}-fsdp")
    assert summary["inside"] == "fsdp"
    for level in ("intra", "cross"):
        counted = summary["levels"][level]
        assert counted["wire_bytes"] == counted["planned_wire_bytes"] > 0, (level, counted)
    # across, the K positions' shards are the model once over, as the owned tensors are with ddp inside
    ddp = _summary(runs / f"{strategy}-ddp")["levels"]["cross"]["wire_bytes"]
    assert summary["levels"]["cross"]["wire_bytes"] == pytest.approx(ddp, rel=1e-3)


@pytest.mark.procs
def test_optimizer_state_is_one_kth_of_a_flat_run(runs):
    sharded = _summary(runs / "ddp-fsdp")["optimizer_state_bytes_per_rank"]
    flat = _summary(runs / "ddp-flat")["optimizer_state_bytes_per_rank"]
    assert sharded / flat == pytest.approx(1 / K, rel=0.02)


@pytest.mark.procs
def test_resume_ends_where_the_uninterrupted_run_does(runs):
    for rank in range(4):
        a, b = _flat(_model(runs / "diloco-fsdp", rank)), _flat(_model(runs / "diloco-resumed", rank))
        assert torch.equal(a, b), rank


@pytest.mark.parametrize("strategy", ["zero1", "demo"])
def test_other_strategies_refused_in_one_line(strategy, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--strategy", strategy, "--workers", "4", "--replicas", "2", "--inside", "fsdp",
            "--steps", "2", "--out", str(out), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert strategy in err and "--inside fsdp" in err, err
    assert not out.exists()

"""FSDP inside replica groups (--inside fsdp), as a user runs it.

At (R, K) = (2, 2) FSDP inside a replica computes what ddp inside computes: ddp (HSDP) and
diloco end on the same parameters (within 1e-5; a rank's checkpoint holds its shard of every
tensor, torch.chunk's rows), every byte FSDP sends goes through the replica's Comm and equals
the plan at both levels, the optimizer state per rank is 1/K of a flat run's, a run stopped
and resumed ends where the uninterrupted one does, and a strategy that does not run on shards
is refused in one line. Seven tiny CLI runs (W <= 4, 4 steps). Through wrap(), param groups
chosen by identity reach the shards' optimizer, and a 0-d parameter is refused in one line
(one W=2 spawn).
"""
from __future__ import annotations

import json

import pytest
import torch
from dist_utils import rel_err, run_dist

import lowcomm

from lowcomm.checkpoint import read, read_state
from lowcomm.cli.main import main

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


# -- through wrap(): the user's param groups on the shards, a scalar refused ---------------------

def _grouped_model_and_optimizer():
    """A tiny GPT; its biases picked by identity (as by name) at lr 0 without decay, the rest at
    lr 1e-2 with decay 0.1."""
    torch.manual_seed(3)
    model = lowcomm.GPT(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=16)
    biases = {id(p) for name, p in model.named_parameters() if name.endswith("bias")}

    def make(params):
        params = list(params)
        return torch.optim.AdamW([{"params": [p for p in params if id(p) in biases], "lr": 0.0, "weight_decay": 0.0},
                                  {"params": [p for p in params if id(p) not in biases]}], lr=1e-2, weight_decay=0.1)
    return model, make, [name.endswith("bias") for name, _ in model.named_parameters()]


def _groups_through_wrap(rank, world):
    out = {}
    for inside in ("fsdp", "ddp"):
        model, make, is_bias = _grouped_model_and_optimizer()
        start = [p.detach().clone() for p in model.parameters()]
        with lowcomm.wrap(model, make, "ddp", replicas=1, inside=inside) as run:
            for step in range(10):
                g = torch.Generator().manual_seed(100 * step + rank)
                seq = torch.randint(0, 256, (2, 17), generator=g)
                run.backward(lowcomm.lm_loss(run.model, (seq[:, :-1], seq[:, 1:])))
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
        out[inside] = {"params": torch.cat([p.detach().reshape(-1) for p in whole]),
                       "biases_moved": [not torch.equal(w.detach(), s) for w, s, b in zip(whole, start, is_bias) if b]}
    scalar = torch.nn.Sequential(torch.nn.Linear(4, 4))
    scalar.register_parameter("temperature", torch.nn.Parameter(torch.tensor(1.0)))
    try:
        lowcomm.wrap(scalar, lambda p: torch.optim.AdamW(p), "ddp", replicas=1, inside="fsdp")
        out["scalar"] = "accepted"
    except Exception as e:  # noqa: BLE001 -- its test says which
        out["scalar"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def through_wrap():
    return run_dist(_groups_through_wrap, 2, timeout=300)


@pytest.mark.procs
def test_param_groups_chosen_by_identity_reach_the_shards(through_wrap):
    """FSDP replaces the model's parameters by shards: the user's make_optimizer sees the model's
    own parameters, and its groups are rebuilt on their shards (lr 0 biases stay put; the run
    equals ddp inside, where the optimizer holds the parameters themselves)."""
    for r in through_wrap:
        assert r["fsdp"]["biases_moved"] and not any(r["fsdp"]["biases_moved"]), "a bias at lr 0 moved under fsdp"
        assert not any(r["ddp"]["biases_moved"])
        err = rel_err(r["fsdp"]["params"], r["ddp"]["params"])
        assert err <= 1e-5, f"fsdp inside differs from ddp inside by {err:.1e} after 10 steps"


@pytest.mark.procs
def test_a_scalar_parameter_under_fsdp_is_refused_in_one_line(through_wrap):
    for r in through_wrap:
        assert r["scalar"].startswith("UsageError: ") and "0-d parameter 'temperature'" in r["scalar"], r["scalar"]
        assert "\n" not in r["scalar"]

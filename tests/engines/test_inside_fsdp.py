"""FSDP inside replica groups (--inside fsdp), as a user runs it.

At (R, K) = (2, 2) FSDP inside a replica computes what ddp inside computes: ddp (HSDP) and
diloco end on the same parameters (within 1e-5; a rank's checkpoint holds its shard of every
tensor, torch.chunk's rows), every byte FSDP sends goes through the replica's Comm and equals
the plan at both levels, the optimizer state per rank is 1/K of a flat run's, a run stopped
and resumed ends where the uninterrupted one does, and a strategy that does not run on shards
is refused in one line. Seven tiny CLI runs (W <= 4, 4 steps). Through wrap(), param groups
chosen by identity reach the shards' optimizer, and a 0-d parameter is refused in one line
(one W=2 spawn). nanoGPT's configure_optimizers (two groups, read from model.named_parameters()
when called, by name or by id) trains as one process does on the global batch, and an optimizer
leaving out tensors is named in one line: a warning, refused when it leaves out all (one W=2 spawn).
"""
from __future__ import annotations

import json
import warnings

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
    return read_state(read(sorted(out.glob("ckpt-*"))[-1]), rank)["strategy"]["parts"]["model"]


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


@pytest.mark.parametrize("strategy", ["powersgd"])
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


def _batch(step, rank):
    seq = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank))
    return seq[:, :-1], seq[:, 1:]


def _trained(model, make, rank, inside, steps):
    """`model`'s tensors, whole (FSDP's shards gathered), after `steps` steps of ddp over one
    replica of every rank with `inside` inside."""
    with lowcomm.wrap(model, make, "ddp", replicas=1, inside=inside) as run:
        for step in range(steps):
            run.backward(lowcomm.lm_loss(run.model, _batch(step, rank)))
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]


def _outcome(call) -> str:
    """"accepted", or the exception `call()` raised as "Type: message"."""
    try:
        call()
        return "accepted"
    except Exception as e:  # noqa: BLE001 -- each test says which it expects
        return f"{type(e).__name__}: {e}"


def _joined(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _groups_through_wrap(rank, world):
    out = {}
    for inside in ("fsdp", "ddp"):
        model, make, is_bias = _grouped_model_and_optimizer()
        start = [p.detach().clone() for p in model.parameters()]
        whole = _trained(model, make, rank, inside, steps=10)
        out[inside] = {"params": _joined(whole),
                       "biases_moved": [not torch.equal(w.detach(), s) for w, s, b in zip(whole, start, is_bias) if b]}
    scalar = torch.nn.Sequential(torch.nn.Linear(4, 4))
    scalar.register_parameter("temperature", torch.nn.Parameter(torch.tensor(1.0)))
    out["scalar"] = _outcome(lambda: lowcomm.wrap(scalar, lambda p: torch.optim.AdamW(p), "ddp", replicas=1,
                                                  inside="fsdp"))
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


# -- an optimizer that reads the model when it is called (nanoGPT's configure_optimizers) ----------

def _configure_optimizers(model, by: str, weight_decay=0.1, lr=1e-2):
    """make_optimizer in nanoGPT's configure_optimizers idiom: weight decay on the tensors with
    dim >= 2, none on the rest, the groups read from model.named_parameters() when it is called,
    by name ("name": the params it is given are not looked at) or by identity ("id": those
    params filtered by the ids read then)."""
    def make(params):
        named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        decay = [p for p in named.values() if p.dim() >= 2]
        no_decay = [p for p in named.values() if p.dim() < 2]
        if by == "id":
            params = list(params)
            decay, no_decay = ([p for p in params if id(p) in {id(q) for q in chosen}] for chosen in (decay, no_decay))
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    return make


def _gpt():
    torch.manual_seed(5)
    return lowcomm.GPT(vocab_size=256, seq_len=16, n_layer=2, n_head=2, d_model=16)


def _configure_optimizers_runs(rank, world, steps=6):
    """Each idiom trained under fsdp inside one replica of `world` ranks, and the one-process
    reference: the same two groups (built the same way) on the global batch, every rank's
    micro-batch; then a make_optimizer whose groups leave out one tensor."""
    reference = _gpt()
    out = {"start": _joined(reference.parameters())}
    optimizer = _configure_optimizers(reference, "name")(reference.parameters())
    for step in range(steps):
        batches = [_batch(step, r) for r in range(world)]
        optimizer.zero_grad()
        lowcomm.lm_loss(reference, tuple(torch.cat(part) for part in zip(*batches))).backward()
        optimizer.step()
    out["reference"] = _joined(reference.parameters())
    for by in ("name", "id"):
        model = _gpt()
        out[by] = _joined(_trained(model, _configure_optimizers(model, by), rank, "fsdp", steps))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        lowcomm.wrap(_gpt(), lambda params: torch.optim.AdamW(list(params)[1:]), "ddp", replicas=1,
                     inside="fsdp").close()
    out["partial"] = [str(w.message) for w in said if "param groups" in str(w.message)]
    out["none"] = _outcome(lambda: lowcomm.wrap(_gpt(), lambda params: torch.optim.AdamW([{"params": []}]), "ddp",
                                                replicas=1, inside="fsdp"))
    return out


@pytest.fixture(scope="module")
def configure_optimizers_runs():
    return run_dist(_configure_optimizers_runs, 2, timeout=300)


@pytest.mark.procs
@pytest.mark.parametrize("by", ["name", "id"])
def test_groups_read_from_the_model_at_call_time_train_as_one_process_does(configure_optimizers_runs, by):
    """FSDP replaced the model's parameters by DTensors: make_optimizer is called while the model
    shows its own parameters again, so groups read from it by name or id are the user's groups
    (decay on the 2-D tensors only), and the run equals one process on the global batch."""
    for r in configure_optimizers_runs:
        moved, err = rel_err(r[by], r["start"]), rel_err(r[by], r["reference"])
        assert moved > 1e-3, f"by {by}: the model did not move ({moved:.1e})"
        assert err <= 1e-5, f"by {by}: fsdp inside differs from the one-process two-group reference by {err:.1e}"


@pytest.mark.procs
def test_an_optimizer_leaving_out_tensors_is_named_in_one_line(configure_optimizers_runs):
    """Leaving out some of the model's tensors is a warning naming the first; all of them refused."""
    for r in configure_optimizers_runs:
        assert len(r["partial"]) == 1 and "leave out 1 of the 20 trainable tensors" in r["partial"][0], r["partial"]
        assert "'tok_emb.weight'" in r["partial"][0] and "\n" not in r["partial"][0]
        assert r["none"].startswith("UsageError: ") and "leave out 20 of the 20" in r["none"], r["none"]
        assert "\n" not in r["none"]

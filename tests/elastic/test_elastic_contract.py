"""The elastic contract every strategy that runs with --elastic keeps (contract/elastic.py),
checked over the registry: a strategy is covered the moment it stops refusing --elastic.

- its declaration is complete: at every commit point of a W=2 run, every member's replicated
  state (every state part not declared LOCAL, contract/parts.py) hashes alike -- a residual
  declared replicated differs per worker and fails here;
- a joiner that loads a peer's commit state holds a fresh worker's local state (every local
  tensor zero; a local θ at the parameters a fresh worker starts from, the ones evaluated; a
  part declared joiner="peer", the local-SGD family's inner AdamW, its donor's) and the
  replicated state of its peer, bit for bit; and the two go on to their next commit point
  with equal replicated states again;
- a no-fault `lowcomm train --elastic` run equals the plain run bit for bit (every step's loss
  and validation loss, the final validation loss and every rank's parameters), at two seeds, flat
  and across replica groups (acco and dpu on --inside ddp; ddp, sparseloco and streaming_diloco on
  --inside fsdp).
Besides each strategy at its defaults, the local-SGD family's outer step a period late (a mean in
flight at every commit point, kept as each member's part of it and re-issued after a change of
membership, a joiner's part empty) and with eager updates (each member's stand-in its own) are
variants of their own. All share one W=2 spawn for the first two; the CLI pair is two short runs each.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.cli.main import main
from lowcomm.contract.parts import LOCAL, after_join, as_joiner, commit_state, member_state, replicated_tensors, tensors
from lowcomm.elastic.transfer import state_hash
from lowcomm.run.driver import make_run
from lowcomm.strategies import available

from dist_utils import run_dist
from elastic_runs import ELASTIC, checkpoint_params_hashes, cli_flags, options

CASES = ELASTIC + ["diloco delayed", "diloco eager", "sparseloco eager", "streaming_diloco eager"]
SEQ, MICRO = 16, 2


def test_the_strategies_that_run_elastically():
    assert set(available()) == set(ELASTIC)


def build(case: str, seed: int):
    torch.manual_seed(seed)
    model = lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=2, n_head=2, d_model=16)
    return make_run(case.partition(" ")[0], model, lowcomm.Comm(),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), accum=2,
                    schedule=lambda step: 1e-2, **options(case))


def to_commit(run, rank: int, after: int) -> int:
    """Train until the first commit point past step `after`; returns that step."""
    o = run.options
    while True:
        step = run.steps_done
        micro = iter(range(1000))
        run.step(lambda: batch(step, rank, next(micro)), lowcomm.lm_loss)
        if run.steps_done > after and run.strategy.elastic.commits_at(o, run.steps_done):
            return run.steps_done


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + micro)
    seq = torch.randint(0, 256, (MICRO, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def commit_hash(run) -> tuple[dict, str]:
    parts = run.strategy.state_parts()
    state = commit_state(parts, run.state_dict())
    return state, state_hash(replicated_tensors(parts, state))


def local_parts(strategy, state: dict) -> dict[str, object]:
    """The value of each of the strategy's local parts in `state`."""
    return {name: state["parts"][name] for name, part in strategy.state_parts().items() if part.kind == LOCAL}


def _join_life(rank, world, names):
    out = {}
    for name in names:
        run = build(name, seed=1234)
        first = to_commit(run, rank, after=2)
        peer, mine = commit_hash(run)
        every = [None] * world
        dist.all_gather_object(every, mine)
        box = [peer if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run.release()
        # Both build a new run, as a re-formed membership does; rank 1 joins from rank 0's state.
        run = build(name, seed=99 + rank)  # other parameters: what it holds must come from the state
        s, parts = run.strategy, run.strategy.state_parts()
        state = as_joiner(parts, box[0]) if rank == 1 else box[0]
        run.load_state_dict(member_state(parts, state))
        if rank == 1:
            after_join(parts)
        loaded = copy.deepcopy(run.state_dict())  # optimizers' state_dict() holds the live tensors
        with run.evaluating() as model:
            start = {k: v.clone() for k, v in model.state_dict().items()}  # θ a fresh worker starts from
        local = {path: (value, start) if path == "model" else value for path, value in local_parts(s, loaded).items()}
        _, joined = commit_hash(run)
        after = [None] * world
        dist.all_gather_object(after, joined)
        second = to_commit(run, rank, after=first)
        _, later = commit_hash(run)
        again = [None] * world
        dist.all_gather_object(again, later)
        run.close()
        out[name] = {"at_commit": every, "joined": after, "again": again, "local": local, "steps": (first, second),
                     "donated": [n for n, part in parts.items() if part.kind == LOCAL and part.joiner == "peer"]}
    return out


@pytest.fixture(scope="module")
def joined():
    return run_dist(_join_life, 2, CASES, timeout=600)


def zero_everywhere(value) -> bool:
    if torch.is_tensor(value):
        return not value.any()
    if isinstance(value, dict):
        return all(zero_everywhere(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(zero_everywhere(v) for v in value)
    return value in (0, None) or isinstance(value, (bool, str))


@pytest.mark.procs
@pytest.mark.parametrize("name", CASES)
def test_every_member_holds_the_replicated_state_alike_at_a_commit(name, joined):
    for rank in range(2):
        r = joined[rank][name]
        assert len(set(r["at_commit"])) == 1, f"{name}: replicated state differs at step {r['steps'][0]}"
        assert len(set(r["again"])) == 1, f"{name}: replicated state differs at step {r['steps'][1]} after a join"


@pytest.mark.procs
@pytest.mark.parametrize("name", CASES)
def test_a_joiner_holds_a_fresh_workers_local_state_and_its_peers_replicated_state(name, joined):
    peer, joiner = joined[0][name], joined[1][name]
    assert joiner["joined"][1] == peer["at_commit"][0], f"{name}: the joiner's replicated state is not its peer's"
    donated = joiner["donated"]
    for path, value in joiner["local"].items():
        if path == "model":  # a local θ: the parameters a fresh worker starts from (θ_global)
            model, start = value
            assert all(torch.equal(model[k], start[k]) for k in start), f"{name}: the joiner's local θ"
        elif path in donated:  # a local part the joiner copies from its donor (the inner AdamW)
            mine, donors = tensors(value), tensors(peer["local"][path])
            assert mine.keys() == donors.keys(), f"{name}: {path}"
            assert all(torch.equal(v, donors[k]) for k, v in mine.items()), f"{name}: the joiner's {path} is not its donor's"
            assert not zero_everywhere(value), f"{name}: the donor's {path} is still empty"
        else:  # an optimizer's: its moments zero, its hyperparameters (param groups) kept
            fresh = value["state"] if isinstance(value, dict) and "param_groups" in value else value
            assert zero_everywhere(fresh), f"{name}: the joiner's {path} is not a fresh worker's (zero)"


# -- a no-fault elastic run equals the plain run bit for bit, through the CLI ----------------------

STEPS = 6
# Validation every 3 steps: between the commit points of the local-SGD family (an elastic run
# evaluates there too, and writes the loss with the step at the next commit).
RUN = ["--workers", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--data",
       "pydoc", "--eval-every", "3", "--eval-batches", "2", "--steps", str(STEPS), "--quiet"]


# Across two replicas of 2 (zero1 and diloco with fsdp: test_elastic_resume.py): acco's and dpu's
# sharded state and round buffers are each position's, across the replicas at that position; with
# FSDP inside, a process's state is its shard of every tensor.
TWO = ["--workers", "4", "--replicas", "2"]
REPLICAS = {**{f"{name}-replicas": (name, TWO) for name in ("acco", "dpu")},
            **{f"{name}-fsdp": (name, [*TWO, "--inside", "fsdp"])
               for name in ("ddp", "sparseloco", "streaming_diloco", "zero1")}}  # zero1: its flat copy of the shards


@pytest.mark.elastic
@pytest.mark.procs
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", [*CASES, *REPLICAS])
def test_a_no_fault_elastic_run_equals_the_plain_run(case, seed, tmp_path, monkeypatch):
    pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    name, layout = REPLICAS.get(case, (case, []))
    plain, elastic = tmp_path / "plain", tmp_path / "elastic"
    run = [*RUN, *cli_flags(name), *layout, "--seed", str(seed)]
    assert main(["train", *run, "--checkpoint-every", str(STEPS), "--out", str(plain)]) == 0
    assert main(["train", *run, "--elastic", "--out", str(elastic)]) == 0
    rows = [[json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()] for out in (plain, elastic)]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]], name
    assert [(r["step"], r.get("val_loss")) for r in rows[0]] == [(r["step"], r.get("val_loss")) for r in rows[1]], name
    assert [r["step"] for r in rows[1] if "val_loss" in r] == [3, 6]
    summaries = [json.loads((out / "summary.json").read_text()) for out in (plain, elastic)]
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    assert summaries[1]["elastic"]["final_params_sha256"] == checkpoint_params_hashes(plain / f"ckpt-{STEPS:06d}")

"""A robust aggregate across replica groups (--replicas R, ddp or fsdp inside): each rank aggregates
its part of every replica's Δ (the tensors its position owns, or its shards of every tensor), the
norms it clips by summed over its replica, so R replicas of K processes end where R single workers
would (the replica check every strategy passes, tests/engines/test_replicas.py): one W=4 spawn,
(R, K) = (2, 2) against (2, 1) on the replicas' first ranks, replica 1 attacking (scale:100) under
median-norm-clip; with --score (patience 1) too, every rank of the replica run holds the single
workers' scores and decisions (a replica's loss the mean of its positions', on the whole moved
model); in the same spawn each aggregator on its halves of hand-made rows equals it on the whole
rows."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.cli.main import main
from lowcomm.comm.control import register_control
from lowcomm.comm.groups import ReplicaLayout, form
from lowcomm.robust import parse_aggregator
from lowcomm.robust.aggregators import spread_over
from lowcomm.run.driver import make_run

from dist_utils import rel_err, run_dist

R, K, MICRO, SEQ, STEPS = 2, 2, 2, 16, 4
# Replica 1 scales its Δ, so that Covenant's clip is at work; sparseloco's top-k in chunks of 8, a
# multiple of each shard's rows (as in test_replicas.py). (At R = 2 centered clipping from the
# median, the mean, moves by two opposite clipped halves: it is the mean; its row norms are checked
# on the aggregator itself below, at W = 3.)
OPTIONS = {"diloco": {}, "sparseloco": {"outer_compress": "topk:2,chunk:8,bits:8"}}
CASES = [("diloco", "ddp"), ("diloco", "fsdp"), ("sparseloco", "fsdp")]
ROWS = torch.randn(3, 24, generator=torch.Generator().manual_seed(3)) * torch.tensor([1.0, 1.0, 40.0]).unsqueeze(1)
SIZES = [8, 16]  # two tensors, each cut in halves across the K = 2 positions (as fsdp shards them)
RULES = ("median-norm-clip", "centered-clip:2")


def _train(name, comm, intra, inside, replica: int, rows: slice, scored: bool = False):
    """The final parameters, whole, on a replica's rank (`intra`) or as a single worker (None), and
    with `scored` (--score, patience 1, replica 1 flipping its Δ's sign) the scored rounds."""
    torch.manual_seed(7)
    model = lowcomm.GPT(vocab_size=256, seq_len=SEQ, n_layer=1, n_head=2, d_model=16)
    attack = dict(attack="sign-flip", score=True, score_patience=1) if scored else dict(attack="scale:100")
    run = make_run(name, model, comm, lambda ps: torch.optim.AdamW(ps, lr=1e-2), accum=1, total_steps=STEPS,
                   replica=intra, inside=inside if intra is not None else "ddp", sync_every=2, sync_by="steps",
                   aggregate="median-norm-clip", attackers="1", **OPTIONS[name], **attack)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + replica)
        # a pattern a tiny GPT learns in a few steps (each token the one before plus 1): an honest Δ scores above 0
        seq = ((torch.randint(0, 64, (K * MICRO, 1), generator=g) + torch.arange(SEQ + 1)) % 64)[rows]
        run.step(lambda: (seq[:, :-1].contiguous(), seq[:, 1:].contiguous()), lowcomm.lm_loss)
    rounds = run.strategy.report().get("score_rounds")
    run.close()
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    params = torch.cat([p.detach().reshape(-1).clone() for p in whole])
    return (params, rounds) if scored else params


def _life(rank, world, cases):
    layout = ReplicaLayout(world, R)
    levels = form(layout)
    single, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks())  # position 0's ranks: the R workers
    control, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks(), backend="gloo")
    register_control(single, control)
    replica, p = layout.replica(rank), layout.position(rank)
    out = {}
    for name, inside in cases:
        grouped = _train(name, levels.cross, levels.intra, inside, replica, slice(p * MICRO, (p + 1) * MICRO))
        flat = _train(name, lowcomm.Comm(single), None, None, replica, slice(None)) if p == 0 else None
        out[name, inside] = (grouped, flat)
        grouped = _train(name, levels.cross, levels.intra, inside, replica, slice(p * MICRO, (p + 1) * MICRO), True)
        flat = _train(name, lowcomm.Comm(single), None, None, replica, slice(None), True) if p == 0 else None
        out[name, inside, "scored"] = (grouped, flat)
    # the aggregators on this position's half of each tensor, their norms summed inside the replica
    halves = [t.chunk(K, dim=1)[p] for t in ROWS.split(SIZES, dim=1)]
    spread = spread_over(SimpleNamespace(comm=levels.intra, name="fsdp"))
    out["rows"] = {rule: parse_aggregator(rule)(torch.cat(halves, dim=1), [h.shape[1] for h in halves], spread=spread)
                   for rule in RULES}
    return out


@pytest.fixture(scope="module")
def runs():
    return run_dist(_life, R * K, CASES, timeout=600)


@pytest.mark.procs
@pytest.mark.parametrize("name,inside", CASES)
def test_a_robust_aggregate_across_replicas_equals_one_worker_per_replica(name, inside, runs):
    flat = [runs[r * K][name, inside][1] for r in range(R)]
    assert rel_err(flat[0], flat[1]) == 0.0  # every worker on the same θ
    for rank, out in enumerate(runs):
        assert rel_err(out[name, inside][0], flat[rank // K]) <= 1e-6, (name, inside, rank)


@pytest.mark.procs
@pytest.mark.parametrize("name,inside", CASES)
def test_a_scored_replica_is_scored_and_judged_as_one_worker(name, inside, runs):
    """Scores within float rounding of the single workers' (the loss on K micro-batches of 2 as the
    mean of K losses), the same on every rank, and the same decisions: the same final θ."""
    (flat_params, flat_rounds) = runs[0][name, inside, "scored"][1]
    assert flat_rounds and any(r["left_out"] for r in flat_rounds), flat_rounds  # the attacker was caught
    for rank, out in enumerate(runs):
        params, rounds = out[name, inside, "scored"][0]
        assert rounds == runs[0][name, inside, "scored"][0][1], rank  # alike on every rank, bit for bit
        assert [r["left_out"] for r in rounds] == [r["left_out"] for r in flat_rounds], (rank, rounds)
        for got, want in zip(rounds, flat_rounds):
            assert got["scores"] == pytest.approx(want["scores"], rel=1e-4, abs=1e-6), (rank, got, want)
        assert rel_err(params, flat_params) <= 1e-6, (name, inside, rank)


@pytest.mark.procs
@pytest.mark.parametrize("rule", RULES)
def test_a_norm_spread_over_a_replica_is_the_whole_rows(rule, runs):
    whole = parse_aggregator(rule)(ROWS, SIZES)
    for rank in range(0, R * K, K):  # a replica's positions: the halves of the whole rows' aggregate
        got = [runs[rank + p]["rows"][rule].split([s // K for s in SIZES]) for p in range(K)]
        mine = torch.cat([torch.cat([got[p][t] for p in range(K)]) for t in range(len(SIZES))])
        assert rel_err(mine, whole) <= 1e-6, rule
    clipped = parse_aggregator(rule)(ROWS[:, :SIZES[0] // K], [SIZES[0] // K])  # a half's norms clip otherwise
    assert rel_err(clipped, whole[:SIZES[0] // K]) > 1e-3


@pytest.mark.parametrize("argv, said", [
    (["--strategy", "streaming_diloco", "--fragments", "2", "--score"],
     "--score does not run across replica groups with --inside ddp and --fragments 2: a position may own no tensor "
     "of a fragment, and a probe moves every position's"),
    (["--strategy", "streaming_diloco", "--fragments", "2", "--aggregate", "centered-clip:1"],
     "--aggregate centered-clip:1 does not run across replica groups with --inside ddp and --fragments 2: a position "
     "may own no tensor of a fragment, and a row's norm needs every position"),
])
def test_what_cannot_run_across_replicas_is_refused_in_one_line(tmp_path, data_file, capfd, argv, said):
    out = tmp_path / "run"
    strategy = [] if "--strategy" in argv else ["--strategy", "diloco"]
    assert main(["train", *strategy, "--workers", "4", "--replicas", "2", *argv, "--data", str(data_file),
                 "--out", str(out)]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [f"error: {said}"]
    assert not out.exists()

"""Each emulated attack's contribution against its definition, the attackers' emulation on one
rank of a stub group (who attacks, the rounds, the oracle for copy and alie), and bad flags;
wrong-data in the CLI's trainer on W = 2 gloo workers (what each rank trains on, what --score
holds of it, what it does to the loss under the mean)."""
from __future__ import annotations

from statistics import NormalDist

import pytest
import torch

import lowcomm
from lowcomm.errors import UsageError
from lowcomm.robust import Attackers, Round, parse_attack, parse_ranks
from lowcomm.robust.attacks import alie_z, wrong_data


def ctx(others=None, history=(), rank=3, attackers=(3,), seed=0):
    return Round(rank, 0, attackers, torch.Generator().manual_seed(seed), others, list(history))


DELTA = torch.tensor([1.0, -2.0, 0.5, 4.0])


def test_the_simple_attacks_follow_their_definitions():
    assert torch.equal(parse_attack("sign-flip")(DELTA, ctx()), -DELTA)
    assert torch.equal(parse_attack("scale:100")(DELTA, ctx()), 100 * DELTA)
    assert torch.equal(parse_attack("scale:-0.5")(DELTA, ctx()), -0.5 * DELTA)
    assert torch.equal(parse_attack("zero")(DELTA, ctx()), torch.zeros(4))
    assert torch.equal(parse_attack("none")(DELTA, ctx()), DELTA)


def test_noise_is_a_gaussian_of_sigma_times_the_norm_and_nothing_of_delta():
    delta = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    sent = parse_attack("noise:2")(delta, ctx(seed=5))
    assert abs(float(sent.norm() / delta.norm()) - 2.0) < 0.05
    assert abs(float(torch.nn.functional.cosine_similarity(sent, delta, dim=0))) < 0.05
    assert abs(float(sent.mean())) < 0.05 * float(sent.std())
    assert torch.equal(sent, parse_attack("noise:2")(delta, ctx(seed=5)))       # the round's generator
    assert not torch.equal(sent, parse_attack("noise:2")(delta, ctx(seed=6)))


def test_copy_replays_an_honest_workers_contribution_of_the_round():
    others = torch.arange(16.0).view(4, 4)  # rank r's Δ: row r; rank 3 attacks
    picked = {tuple(parse_attack("copy")(others[3], ctx(others, seed=s)).tolist()) for s in range(20)}
    assert picked == {tuple(others[r].tolist()) for r in range(3)}  # any honest row, never its own


def test_stale_sends_what_it_sent_n_rounds_before():
    history = [torch.full((4,), float(k)) for k in range(5)]  # sent in rounds 0..4, the current one is 5
    assert torch.equal(parse_attack("stale:2")(DELTA, ctx(history=history)), history[3])
    assert torch.equal(parse_attack("stale:5")(DELTA, ctx(history=history)), history[0])
    assert torch.equal(parse_attack("stale:6")(DELTA, ctx(history=history)), DELTA)  # nothing that old: honest


def test_alie_shifts_the_honest_mean_by_z_standard_deviations():
    others = torch.tensor([[1.0, 2.0], [3.0, 2.0], [5.0, 8.0], [100.0, 100.0]])
    honest = others[:3]
    sent = parse_attack("alie:1.5")(others[3], ctx(others))
    assert torch.allclose(sent, honest.mean(0) - 1.5 * honest.std(0, unbiased=False))
    # the paper's z_max: s = ⌊W/2 + 1⌋ − f, z = Φ⁻¹((W − s)/W)
    assert alie_z(8, 2) == pytest.approx(NormalDist().inv_cdf((8 - 3) / 8))
    assert alie_z(4, 1) == pytest.approx(0.0, abs=1e-9)
    default = parse_attack("alie")(others[3], ctx(others))
    assert torch.allclose(default, honest.mean(0) - alie_z(4, 1) * honest.std(0, unbiased=False))


class StubComm:
    """Rank `rank` of a group whose Δ rows are `rows`: meta_all_gather hands them back, and counts."""

    def __init__(self, rank, rows):
        self.rank, self.rows, self.gathers = rank, rows, 0

    def meta_all_gather(self, tensor):
        self.gathers += 1
        return self.rows.clone()


def test_only_the_named_ranks_attack_and_every_rank_counts_the_rounds():
    rows = torch.arange(12.0).view(3, 4)
    for rank in range(3):
        comm, attackers = StubComm(rank, rows), Attackers(parse_attack("stale:1"), (1,), seed=0)
        sent = [attackers.contribution(comm, "fragment0", rows[rank] + k) for k in range(3)]
        # rank 1 replays what it sent a round before: round 0 honest, then round 0's twice
        want = [rows[rank] + k for k in range(3)] if rank != 1 else [rows[1], rows[1], rows[1]]
        assert all(torch.equal(a, b) for a, b in zip(sent, want)), rank
        assert attackers.rounds == {"fragment0": 3} and comm.gathers == 0  # stale reads no other worker


def test_copy_and_alie_learn_the_others_through_one_gather_on_every_rank():
    rows = torch.arange(12.0).view(3, 4)
    for kind in ("copy", "alie"):
        for rank in range(3):
            comm = StubComm(rank, rows)
            sent = Attackers(parse_attack(kind), (2,), seed=0).contribution(comm, "fragment0", rows[rank])
            assert comm.gathers == 1
            assert torch.equal(sent, rows[rank]) == (rank != 2), (kind, rank)


@pytest.mark.parametrize("spec, says", [("flip", "'flip' is not one of"), ("scale:x", "got 'x'"),
                                        ("noise:-1", "got '-1'"), ("stale:0", "got '0'"), ("stale:1.5", "got '1.5'"),
                                        ("zero:3", "'zero:3' is not one of")])
def test_a_bad_attack_is_named(spec, says):
    with pytest.raises(UsageError, match=says):
        parse_attack(spec)


def test_ranks_parse_and_a_bad_rank_is_named():
    assert parse_ranks("6,5") == (5, 6) and parse_ranks("") == ()
    for raw, says in (("a", "'a' is not a worker rank"), ("1,-2", "rank -2 is negative"), ("2,2", "names a rank twice")):
        with pytest.raises(UsageError, match=says):
            parse_ranks(raw)


def test_wrong_data_reads_each_window_backwards():
    windows = torch.arange(2 * 6).view(2, 6)              # two windows of T + 1 = 6 tokens
    x, y = windows[:, :-1], windows[:, 1:]
    wx, wy = wrong_data((x, y))
    backwards = windows.flip(-1)
    assert torch.equal(wx, backwards[:, :-1]) and torch.equal(wy, backwards[:, 1:])
    assert parse_attack("wrong-data").on_data and not parse_attack("sign-flip").on_data
    assert torch.equal(parse_attack("wrong-data")(DELTA, ctx()), DELTA)  # its Δ is sent as is


def test_a_loop_of_your_own_is_refused_wrong_data():
    model = lowcomm.GPT(vocab_size=32, seq_len=8, n_layer=1, n_head=2, d_model=8)
    with pytest.raises(UsageError, match="attack='wrong-data' changes the data a worker trains on"):
        lowcomm.wrap(model, lambda p: torch.optim.AdamW(p), "diloco", attack="wrong-data", attackers="0")


# -- wrong-data in the CLI's trainer: W = 2 gloo workers, rank 1 attacking -------------------------

WRONG = ["--strategy", "diloco", "--workers", "2", "--n-layer", "1", "--n-head", "2", "--d-model", "32",
         "--seq-len", "16", "--micro-batch", "4", "--lr", "3e-3", "--warmup", "0", "--eval-every", "0",
         "--eval-batches", "4", "--quiet"]
LOSS_STEPS, SEEDS = 40, (0, 1)
# Text whose direction the tiny model learns in a few steps (each letter followed by the next):
# read backwards, each is followed by the one before, and the mean of the two moves is neither.
ALPHABET = "abcdefghijklmnopqrstuvwxyz" * 400


def _config(data: str, out: str, *flags: str):
    from lowcomm import config as C
    from lowcomm.cli.main import build_parser, config_from_args
    cfg = config_from_args(build_parser().parse_args(["train", *WRONG, "--data", data, "--out", out, *flags]))
    C.validate(cfg)
    return cfg


def _watched_run(rank: int, cfg) -> dict:
    """A scored run: what the loader gave this rank (its shard's batches), what its model trained
    on (the training forwards' inputs) and the sequences its scoring held at each sync."""
    from lowcomm.train.worker import build, run_plain
    t = build(cfg, rank, 2, local_rank=0)
    assigned, trained_on, held = [], [], []
    read, take = t.loader.next, t.run.strategy.sync.scoring.held.take
    t.loader.next = lambda: assigned.append(read()) or assigned[-1]
    t.model.register_forward_pre_hook(  # a training forward (not an evaluation, not the scoring's probes)
        lambda m, args: trained_on.append(args[0].clone()) if m.training and torch.is_grad_enabled() else None)
    t.run.strategy.sync.scoring.held.take = lambda: held.append(take()) or held[-1]
    from lowcomm.errors import UsageError
    own_backward = None
    if rank == 1:  # the attacker fed a loss of its caller's own, which the data attack cannot reach: refused
        try:
            t.run.backward(sum(p.sum() for p in t.model.parameters()) * 0)
        except UsageError as e:
            own_backward = str(e)
    try:
        run_plain(t, None, quiet=True)
    finally:
        t.run.close()
    said = {k: v for k, v in t.run.strategy.report().items() if k in ("attack", "attackers")}  # summary.json's
    return {"assigned": assigned, "trained_on": trained_on, "held": held, "said": said, "own_backward": own_backward}


def _final_loss(rank: int, cfg) -> float:
    from lowcomm.train.worker import build, run_plain
    t = build(cfg, rank, 2, local_rank=0)
    try:
        return run_plain(t, None, quiet=True).val_loss
    finally:
        t.run.close()


def _wrong_data(rank: int, world: int, data: str, out: str) -> dict:
    attack = ["--attack", "wrong-data", "--attackers", "1"]
    watched = _watched_run(rank, _config(data, f"{out}/watched", "--steps", "4", "--sync-every", "2", "--score",
                                         "--score-batches", "3", *attack))
    losses = {(kind, seed): _final_loss(rank, _config(data, f"{out}/{kind}{seed}", "--steps", str(LOSS_STEPS),
                                                      "--sync-every", "5", "--seed", str(seed),
                                                      *(attack if kind == "wrong" else [])))
              for seed in SEEDS for kind in ("clean", "wrong")}
    return {"watched": watched, "losses": losses}


@pytest.fixture(scope="module")
def wrong_data_ranks(tmp_path_factory):
    from dist_utils import run_dist
    root = tmp_path_factory.mktemp("wrong-data")
    (root / "text.txt").write_text(ALPHABET)
    return run_dist(_wrong_data, 2, str(root / "text.txt"), str(root), timeout=600)


@pytest.mark.procs
def test_the_wrong_data_attacker_trains_on_its_windows_backwards_and_the_honest_on_theirs(wrong_data_ranks):
    for rank in (0, 1):
        seen = wrong_data_ranks[rank]["watched"]
        assert len(seen["assigned"]) == len(seen["trained_on"]) == 4, rank
        for (x, y), inputs in zip(seen["assigned"], seen["trained_on"]):
            assert torch.equal(inputs, y.flip(-1) if rank == 1 else x), rank
        assert seen["said"] == {"attack": "wrong-data", "attackers": [1]}, rank
    assert "drive the run with step(next_batch, loss_fn)" in wrong_data_ranks[1]["watched"]["own_backward"]
    shards = [torch.cat([x for x, _ in wrong_data_ranks[r]["watched"]["assigned"]]) for r in (0, 1)]
    assert not torch.equal(shards[0], shards[1])  # each its own shard


@pytest.mark.procs
def test_the_attackers_scored_sequences_are_its_assigned_ones(wrong_data_ranks):
    """--score holds the first --score-batches sequences of each period's assigned data (a
    validator's knowledge of the worker), not the reversed windows the attacker trained on."""
    for rank in (0, 1):
        seen = wrong_data_ranks[rank]["watched"]
        want = [seen["assigned"][step][0][:3] for step in (0, 2)]  # each period's first micro-batch
        assert len(seen["held"]) == 2 and all(torch.equal(h, w) for h, w in zip(seen["held"], want)), rank


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_wrong_data_raises_the_loss_under_the_mean(wrong_data_ranks, seed):
    losses = wrong_data_ranks[0]["losses"]
    assert wrong_data_ranks[1]["losses"] == losses  # every worker evaluates θ_global alike
    assert losses[("wrong", seed)] > losses[("clean", seed)] + 0.3, losses  # measured: 0.61 -> 1.37, 0.65 -> 1.35

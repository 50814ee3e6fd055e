"""Each emulated attack's contribution against its definition, the attackers' emulation on one
rank of a stub group (who attacks, the rounds, the oracle for copy and alie), and bad flags."""
from __future__ import annotations

from statistics import NormalDist

import pytest
import torch

from lowcomm.errors import UsageError
from lowcomm.robust import Attackers, Round, parse_attack, parse_ranks
from lowcomm.robust.attacks import alie_z


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

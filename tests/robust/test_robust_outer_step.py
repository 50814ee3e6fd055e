"""The outer step under emulated attackers, on W = 3 gloo workers (rank 2 attacks): every
worker ends each step on the same θ_global under every attack and aggregator (DeMo: the same
θ), a scale or sign-flip attacker moves the loss under `mean` and much less under a robust
aggregator (two seeds; diloco, sparseloco, demo), scoring leaves out and names attackers, the bytes counted are the plan's (a robust aggregate's all-gather; an attack's oracle
is bookkeeping, not the strategy's), and `--aggregate mean` with no attacker is today's run.

The batches follow a pattern a tiny GPT learns in a few steps (each token the one before
plus 1, mod 64), so that a damaged outer step shows in the loss."""
from __future__ import annotations

import copy
import hashlib

import pytest
import torch

import lowcomm
from lowcomm.run.driver import make_run

from dist_utils import run_dist
from local_sgd import SEQ, make_model, plan_bytes

W, STEPS, ATTACKER, SEEDS = 3, 12, "2", (0, 1)
BASE = dict(sync_every=3)
SCENARIOS = {  # name: (strategy, options), every one run with each seed
    "clean": ("diloco", {}),
    "clean-mean": ("diloco", dict(aggregate="mean")),
    "scale-mean": ("diloco", dict(attack="scale:100")),
    "scale-median": ("diloco", dict(attack="scale:100", aggregate="median")),
    "scale-mnc": ("diloco", dict(attack="scale:100", aggregate="median-norm-clip")),
    "flip-mean": ("diloco", dict(attack="sign-flip")),
    "flip-median": ("diloco", dict(attack="sign-flip", aggregate="median")),
    "copy-trimmed": ("diloco", dict(attack="copy", aggregate="trimmed:0.34")),
    "alie-cclip": ("diloco", dict(attack="alie:1", aggregate="centered-clip:0.05")),
    "noise-median": ("streaming_diloco", dict(attack="noise:1", aggregate="median", fragments=3, fragment_delay=1)),
    "score-clean": ("diloco", dict(score=True)),
    "score-flip": ("diloco", dict(attack="sign-flip", score=True)),
    "score-copy": ("diloco", dict(attack="copy", score=True)),
    "score-stale": ("diloco", dict(attack="stale:1", score=True)),
    "score-zero": ("sparseloco", dict(attack="zero", score=True, aggregate="median-norm-clip")),
    "score-sparse-copy": ("sparseloco", dict(attack="copy", score=True)),  # the copied payload's very bytes
    "score-streaming-flip": ("streaming_diloco", dict(attack="sign-flip", score=True, fragments=3, fragment_delay=1)),
    # DeMo gathers every worker's DCT top-k itself and steps on sign(Q): a scale attack only
    # reverses it when negative
    "demo-clean": ("demo", {}),
    "demo-negscale-mean": ("demo", dict(attack="scale:-100")),
    "demo-negscale-median": ("demo", dict(attack="scale:-100", aggregate="median")),
    "demo-alie-mnc": ("demo", dict(attack="alie:1", aggregate="median-norm-clip")),
    "sparse-clean": ("sparseloco", {}),
    "sparse-scale-mean": ("sparseloco", dict(attack="scale:100")),
    "sparse-scale-mnc": ("sparseloco", dict(attack="scale:100", aggregate="median-norm-clip")),
    # --score on the compressed wire: rows scored as the median-norm clip takes them; patience 1
    "sparse-score-scale": ("sparseloco", dict(attack="scale:100", aggregate="median-norm-clip", score=True)),
    "sparse-score-flip": ("sparseloco", dict(attack="sign-flip", aggregate="median-norm-clip", score=True)),
}


def options_of(name: str) -> dict:
    options = {**(BASE if SCENARIOS[name][0] != "demo" else {}), **SCENARIOS[name][1]}
    return {**options, "attackers": ATTACKER} if "attack" in options else options


def batch(step: int, rank: int, seed: int, micro: int = 0):
    g = torch.Generator().manual_seed(1_000_000 * seed + 1000 * step + 10 * rank + micro)
    seq = (torch.randint(0, 64, (4, 1), generator=g) + torch.arange(SEQ + 1)) % 64
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _scenario(rank: int, name: str, seed: int) -> dict:
    """One run: θ_global's hash after every step, the counted bytes, the final held-out loss."""
    torch.manual_seed(seed)
    model = make_model()
    run = make_run(SCENARIOS[name][0], model, lowcomm.Comm(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                   total_steps=STEPS, **options_of(name))
    hashes = []
    for _ in range(STEPS):
        step = run.steps_done
        run.step(lambda: batch(step, rank, seed), lowcomm.lm_loss)
        held = run.strategy.sync.globals if hasattr(run.strategy, "sync") else model.parameters()  # θ_global, demo's θ
        flat = torch.cat([g.detach().reshape(-1) for g in held])
        hashes.append(hashlib.sha1(flat.numpy().tobytes()).hexdigest())
    counted = run.comm.snapshot().wire_bytes
    run.close()
    with torch.no_grad():
        loss = sum(float(lowcomm.lm_loss(model, batch(10_000, 0, seed, m))) for m in range(4)) / 4
    return {"hashes": hashes, "bytes": counted, "loss": loss, "rounds": run.strategy.report().get("score_rounds")}


def _resumed(rank: int) -> dict:
    """A scored run with a stale:2 attacker, its state taken after step 7 (mid-period) and loaded
    into a fresh run: both go on to step 12."""
    runs, hashes = [], [[], []]
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(make_run("diloco", make_model(), lowcomm.Comm(), lambda p: torch.optim.AdamW(p, lr=1e-2),
                             total_steps=STEPS, sync_every=3, score=True, attack="stale:2", attackers=ATTACKER))
    for _ in range(7):
        step = runs[0].steps_done
        runs[0].step(lambda: batch(step, rank, 0), lowcomm.lm_loss)
    runs[1].load_state_dict(copy.deepcopy(runs[0].state_dict()))  # a copy: the state holds live tensors
    for _ in range(STEPS - 7):
        for k, run in enumerate(runs):
            step = run.steps_done
            run.step(lambda: batch(step, rank, 0), lowcomm.lm_loss)
            hashes[k].append(hashlib.sha1(torch.cat([g.detach().reshape(-1) for g in run.strategy.sync.globals])
                                          .numpy().tobytes()).hexdigest())
    for run in runs:
        run.close()
    return {"hashes": hashes, "rounds": [run.strategy.report()["score_rounds"] for run in runs]}


def _all(rank: int, world: int) -> dict:
    return {**{(name, seed): _scenario(rank, name, seed) for seed in SEEDS for name in SCENARIOS},
            "resumed": _resumed(rank)}


@pytest.fixture(scope="module")
def ranks():
    return run_dist(_all, W, timeout=600)


def loss(ranks, name, seed) -> float:
    return ranks[0][(name, seed)]["loss"]


@pytest.mark.procs
def test_every_worker_holds_the_same_global_model_at_every_step(ranks):
    for key in (k for k in ranks[0] if k != "resumed"):
        for r in (1, 2):  # the attacker too: it runs the protocol as the others do
            assert ranks[r][key]["hashes"] == ranks[0][key]["hashes"], f"{key}: rank {r} differs from rank 0"
        assert len(set(ranks[0][key]["hashes"])) >= STEPS // BASE["sync_every"], f"{key}: θ_global never moved"


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_a_scale_attacker_wrecks_the_mean_and_not_a_robust_aggregate(ranks, seed):
    clean = loss(ranks, "clean", seed)
    assert loss(ranks, "scale-mean", seed) > clean + 10  # diverged
    for robust in ("scale-median", "scale-mnc"):
        assert abs(loss(ranks, robust, seed) - clean) < 0.25, (robust, loss(ranks, robust, seed), clean)
    sparse = loss(ranks, "sparse-clean", seed)
    assert loss(ranks, "sparse-scale-mean", seed) > sparse + 10
    assert abs(loss(ranks, "sparse-scale-mnc", seed) - sparse) < 0.1


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_demo_a_reversing_attacker_wrecks_the_mean_and_not_the_median(ranks, seed):
    clean = loss(ranks, "demo-clean", seed)
    assert loss(ranks, "demo-negscale-mean", seed) > clean + 2  # sign(Q) follows the attacker
    assert abs(loss(ranks, "demo-negscale-median", seed) - clean) < 0.5


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_a_sign_flip_attacker_hurts_the_median_less_than_the_mean(ranks, seed):
    clean = loss(ranks, "clean", seed)
    hurt_mean, hurt_median = loss(ranks, "flip-mean", seed) - clean, loss(ranks, "flip-median", seed) - clean
    assert hurt_mean > 1.0 and hurt_median < 0.6 * hurt_mean, (hurt_mean, hurt_median)


@pytest.mark.procs
def test_counted_bytes_are_the_plans(ranks):
    """A robust aggregate all-gathers (W−1)·n·4 bytes a sync on fp32; copy's and alie's look at the
    other workers is bookkeeping (Comm.meta), not counted with the strategy's bytes."""
    for name, (strategy, _) in SCENARIOS.items():
        want = plan_bytes(strategy, W, STEPS, options_of(name))
        for r in range(W):
            assert ranks[r][(name, 0)]["bytes"] == want, f"{name} rank {r}"
    gathered, reduced = ranks[0][("scale-median", 0)]["bytes"], ranks[0][("clean", 0)]["bytes"]
    assert gathered == pytest.approx(reduced * (W - 1) / (2 * (W - 1) / W), rel=1e-3)  # all_gather vs all_reduce


@pytest.mark.procs
def test_aggregate_mean_without_attackers_is_todays_run(ranks):
    for seed in SEEDS:
        assert ranks[0][("clean-mean", seed)]["hashes"] == ranks[0][("clean", seed)]["hashes"]


def rounds(ranks, name, seed) -> list[dict]:
    return ranks[0][(name, seed)]["rounds"]


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_scoring_leaves_out_a_sign_flipper_and_names_replays(ranks, seed):
    for r in (1, 2):
        assert ranks[r][("score-flip", seed)]["rounds"] == rounds(ranks, "score-flip", seed)  # decided alike
    flip = rounds(ranks, "score-flip", seed)
    assert all(s < 0 for s in (k["scores"][2] for k in flip)) and all(min(k["scores"][:2]) > 0 for k in flip)
    assert [k["left_out"] for k in flip] == [[], [], [2], [2]]  # after --score-patience (3) rounds
    assert "worker 2 left out: its score was negative for 3 rounds" in flip[2]["events"]
    for k in rounds(ranks, "score-copy", seed) + rounds(ranks, "score-sparse-copy", seed):
        assert k["left_out"] == [] and k["copies"] in ([[0, 2]], [[1, 2]]) \
            and k["events"][0] == f"workers {k['copies'][0][0]} and 2 sent the same contribution (a copy by one of them: counted once)"
    stale = rounds(ranks, "score-stale", seed)
    assert stale[0]["left_out"] == [] and all(k["left_out"] == [2] for k in stale[1:])
    assert all(k["events"] == ["worker 2 sent a contribution of round 0 (stale)"] for k in stale[1:])
    assert all(k["left_out"] == [2] and "sent nothing" in k["events"][0] for k in rounds(ranks, "score-zero", seed))
    # streaming: a round is one fragment's sync (11 regular, then the final sync's 3)
    assert [k["left_out"] for k in rounds(ranks, "score-streaming-flip", seed)] == [[], []] + [[2]] * 12


@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_scoring_an_honest_run_leaves_nobody_out_and_keeps_its_loss(ranks, seed):
    honest = rounds(ranks, "score-clean", seed)
    assert len(honest) == STEPS // BASE["sync_every"] and not any(k["left_out"] or k["events"] for k in honest)
    assert abs(loss(ranks, "score-clean", seed) - loss(ranks, "clean", seed)) < 1e-3


@pytest.mark.procs
def test_a_scored_attacked_run_resumes_as_it_would_have_gone_on(ranks):
    """The scoreboard, the held sequences and the attacker's replays are state: a run loaded from
    a mid-period state scores, replays and moves as the uninterrupted one."""
    for r in range(W):
        resumed = ranks[r]["resumed"]
        assert resumed["hashes"][1] == resumed["hashes"][0], f"rank {r}"
        assert resumed["rounds"][1] == resumed["rounds"][0] and len(resumed["rounds"][0]) == 4
        assert any("(stale)" in e for k in resumed["rounds"][0][2:] for e in k["events"])



@pytest.mark.procs
@pytest.mark.parametrize("seed", SEEDS)
def test_sparseloco_scores_rows_as_the_median_norm_clip_takes_them_and_leaves_out_at_once(ranks, seed):
    """On SparseLoCo's compressed wire under median-norm-clip a row is scored clipped to the median
    norm, as Covenant's validator applies a peer's payload: a scale:100 attacker is scored as the
    honest-norm row it becomes (unclipped, its 100x probe scored over ten times an honest one) and kept, and the
    run is median-norm-clip's own. A sign-flipper is left out at its first negative score
    (sparseloco's --score-patience 1), from round 0: its run is then, bit for bit, the one whose
    attacker sends nothing (left out of every round), the floor of any defence."""
    scale = rounds(ranks, "sparse-score-scale", seed)
    for k in scale:
        assert not k["left_out"] and 0 < k["scores"][2] < 3 * max(k["scores"][:2]), k
    assert ranks[0][("sparse-score-scale", seed)]["hashes"] == ranks[0][("sparse-scale-mnc", seed)]["hashes"]
    flip = rounds(ranks, "sparse-score-flip", seed)
    assert [k["left_out"] for k in flip] == [[2]] * 4 and all(k["scores"][2] < 0 for k in flip)
    assert ranks[0][("sparse-score-flip", seed)]["hashes"] == ranks[0][("score-zero", seed)]["hashes"]

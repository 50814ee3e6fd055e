"""DeMo with --score on W = 3 gloo workers (rank 2 attacks), every --score-every 2 steps: a
sign-flipper and a scale:-100 sender are left out after --score-patience rounds and stay out
between scored steps, a copier is named at once, every worker holds the same θ at every step,
the probe's scores equal a single-process transcription of the rule (θ − 0.2·lr·sign(Q_r) on the
next worker's held sequences), an honest scored run is the plain run bit for bit, and a run
resumed from its state mid-period goes on as the uninterrupted one; through the trainer, each round
is on the record of the step that scored it in steps.jsonl, as in summary.json, and the progress
line says who was left out.

The batches follow a pattern a tiny GPT learns in a few steps (each token the one before plus 1,
mod 64), so that a reversed step shows in the loss and in the scores."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

import lowcomm
from lowcomm.cli.main import build_parser, config_from_args
from lowcomm.compress.dct import DCTTopK
from lowcomm.run.driver import make_run

from dist_utils import run_dist
from local_sgd import SEQ, make_model

W, STEPS, EVERY, SEED, LR = 3, 12, 2, 0, 1e-2
ROUNDS = STEPS // EVERY  # scored at optimizer steps 0, 2, ..., 10
SCENARIOS = {  # name: options (rank 2 attacks where an attack is named)
    "plain": {},
    "clean": dict(score=True),
    "flip": dict(score=True, attack="sign-flip"),
    "flip-unscored": dict(attack="sign-flip"),
    "negscale-mnc": dict(score=True, attack="scale:-100", aggregate="median-norm-clip"),
    "copy": dict(score=True, attack="copy"),
}


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + SEED)
    seq = (torch.randint(0, 64, (4, 1), generator=g) + torch.arange(SEQ + 1)) % 64
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build(options: dict):
    torch.manual_seed(SEED)
    model = make_model()
    scored = dict(score_every=EVERY) if options.get("score") else {}
    attackers = dict(attackers="2") if "attack" in options else {}
    run = make_run("demo", model, lowcomm.Comm(), lambda p: torch.optim.AdamW(p, lr=LR), total_steps=STEPS,
                   **options, **scored, **attackers)
    return model, run


def digest(model) -> str:
    return hashlib.sha1(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()).hexdigest()


def _scenario(rank: int, options: dict) -> dict:
    model, run = build(options)
    hashes = []
    for _ in range(STEPS):
        step = run.steps_done
        run.step(lambda: batch(step, rank), lowcomm.lm_loss)
        hashes.append(digest(model))
    report = run.strategy.report()
    run.close()
    with torch.no_grad():
        loss = float(lowcomm.lm_loss(model, batch(10_000, 0)))
    return {"hashes": hashes, "rounds": report.get("score_rounds"), "loss": loss}


def _resumed(rank: int, options: dict) -> dict:
    """A run of `options`, its state taken after step 5 (mid-period) and loaded into a fresh run:
    both go on to the end."""
    runs = [build(options) for _ in range(2)]
    for _ in range(5):
        step = runs[0][1].steps_done
        runs[0][1].step(lambda: batch(step, rank), lowcomm.lm_loss)
    runs[1][1].load_state_dict(copy.deepcopy(runs[0][1].state_dict()))  # a copy: the state holds live tensors
    hashes = [[], []]
    for _ in range(STEPS - 5):
        for k, (model, run) in enumerate(runs):
            step = run.steps_done
            run.step(lambda: batch(step, rank), lowcomm.lm_loss)
            hashes[k].append(digest(model))
    out = {"hashes": hashes, "rounds": [run.strategy.report().get("score_rounds") for _, run in runs]}
    for _, run in runs:
        run.close()
    return out


def _trained(rank: int, data: str, out: Path) -> dict:
    """The trainer's scored run with a sign-flipper (patience 1): rank 0's progress lines and logs."""
    from lowcomm import config as C
    from lowcomm.train.worker import train
    argv = ["train", "--strategy", "demo", "--workers", str(W), "--steps", str(STEPS), "--n-layer", "1",
            "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--micro-batch", "4", "--eval-every", "0",
            "--eval-batches", "1", "--log-every", "5", "--score", "--score-every", str(EVERY), "--score-patience",
            "1", "--attack", "sign-flip", "--attackers", "2", "--data", data, "--out", str(out)]
    cfg = config_from_args(build_parser().parse_args(argv))
    C.validate(cfg)
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        train(cfg, rank, W, 0, out if rank == 0 else None, quiet=False)
    if rank:
        return {"shown": shown.getvalue()}
    return {"shown": shown.getvalue(), "summary": json.loads((out / "summary.json").read_text()),
            "steps": [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]}


def _all(rank: int, world: int, data: str, out: str) -> dict:
    return {**{name: _scenario(rank, options) for name, options in SCENARIOS.items()},
            "resumed": _resumed(rank, SCENARIOS["flip"]), "resumed-noise": _resumed(rank, dict(attack="noise:1")),
            "trained": _trained(rank, data, Path(out))}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_scored")
    (root / "run").mkdir()  # made by the test, as `lowcomm train` makes it before its workers start
    data = root / "text.txt"
    data.write_text("It is a truth universally acknowledged, that a single man in possession of a good "
                    "fortune, must be in want of a wife.\n" * 60)
    return run_dist(_all, W, str(data), str(root / "run"), timeout=600)


@pytest.mark.procs
def test_every_worker_holds_the_same_model_and_decides_alike(ranks):
    for name in SCENARIOS:
        for r in (1, 2):  # the attacker too: it runs the protocol as the others do
            assert ranks[r][name]["hashes"] == ranks[0][name]["hashes"], f"{name}: rank {r} differs from rank 0"
            assert ranks[r][name]["rounds"] == ranks[0][name]["rounds"], f"{name}: rank {r} judged otherwise"
        assert len(set(ranks[0][name]["hashes"])) == STEPS, f"{name}: a step did not move θ"


@pytest.mark.procs
@pytest.mark.parametrize("name", ["flip", "negscale-mnc"])
def test_a_reversing_sender_is_left_out_after_patience_rounds_and_stays_out(ranks, name):
    rounds = ranks[0][name]["rounds"]
    assert [k["round"] for k in rounds] == list(range(ROUNDS))
    assert all(k["scores"][2] < 0 for k in rounds), [k["scores"] for k in rounds]
    assert rounds[0]["scores"][2] < 0 < min(rounds[0]["scores"][:2])  # (near the end an honest step may not help)
    assert [k["left_out"] for k in rounds] == [[], [], [2], [2], [2], [2]]  # --score-patience 3
    assert rounds[2]["events"] == ["worker 2 left out: its score was negative for 3 rounds"]


@pytest.mark.procs
def test_leaving_the_flipper_out_brings_the_loss_back_toward_the_honest_run(ranks):
    clean, flipped, scored = (ranks[0][n]["loss"] for n in ("clean", "flip-unscored", "flip"))
    assert flipped - clean > 0.2, (flipped, clean)  # the flipper reverses sign(Q) where it outweighs
    # left out from step 4 of 12: part of the damage is done by then, the rest is not
    assert flipped - scored > 0.25 * (flipped - clean), (scored, flipped, clean)


@pytest.mark.procs
def test_a_copier_is_named_at_every_scored_step(ranks):
    rounds = ranks[0]["copy"]["rounds"]
    assert len(rounds) == ROUNDS
    for k in rounds:
        assert k["left_out"] == [] and k["copies"] in ([[0, 2]], [[1, 2]]) and len(k["events"]) == 1, k
        assert k["events"][0] == f"workers {k['copies'][0][0]} and 2 sent the same contribution (a copy by one of them: counted once)"


@pytest.mark.procs
def test_an_honest_scored_run_is_the_plain_run_bit_for_bit(ranks):
    """Nobody left out, the probes put θ back exactly: scoring changes no bit of the training."""
    assert all(k["left_out"] == [] for k in ranks[0]["clean"]["rounds"])
    assert ranks[0]["clean"]["hashes"] == ranks[0]["plain"]["hashes"]
    assert ranks[0]["plain"]["rounds"] is None


@pytest.mark.procs
def test_a_resumed_scored_run_goes_on_as_the_uninterrupted_one(ranks):
    for r in range(W):
        got = ranks[r]["resumed"]
        assert got["hashes"][1] == got["hashes"][0], f"rank {r}"
        assert got["rounds"][1] == got["rounds"][0], f"rank {r}"
    assert [k["left_out"] for k in ranks[0]["resumed"]["rounds"][0]] == [[], [], [2], [2], [2], [2]]


@pytest.mark.procs
def test_a_resumed_attacker_draws_as_the_uninterrupted_one(ranks):
    """noise:1's draws are seeded by the round: the resumed attacker counts its rounds from the state."""
    for r in range(W):
        got = ranks[r]["resumed-noise"]
        assert got["hashes"][1] == got["hashes"][0], f"rank {r}"


def transcribed_scores() -> list[float]:
    """Round 0's scores by hand: each worker's first DeMo step on its step-0 batch (δ̂ = lr·DCT(g),
    top-k per chunk, decoded alone; rank 2's values negated), probed at θ0 − 0.2·lr·sign(Q_r) on
    the next worker's held sequences (its step-0 input, each predicting its next token):
    (L(θ0) − L(probe)) / L(θ0)."""
    torch.manual_seed(SEED)
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    theta = [p.detach().clone() for p in params]
    signs = []
    for r in range(W):
        model.zero_grad()
        lowcomm.lm_loss(model, batch(0, r)).backward()
        qs = []
        for p in params:
            enc = DCTTopK(tuple(p.shape), 64, 32)
            idx, val = enc.topk(enc.encode(LR * p.grad.float()))
            qs.append(enc.decompress([idx], [-val if r == 2 else val]).sign())
        signs.append(qs)
    scores = []
    with torch.no_grad():
        for r in range(W):
            ids = batch(0, (r + 1) % W)[0]
            other = ids[:, :-1], ids[:, 1:]
            base = float(lowcomm.lm_loss(model, other))
            for p, t, q in zip(params, theta, signs[r]):
                p.copy_(t - 0.2 * LR * q)
            scores.append((base - float(lowcomm.lm_loss(model, other))) / base)
            for p, t in zip(params, theta):
                p.copy_(t)
    return scores


@pytest.mark.procs
def test_the_probe_is_the_rule_transcribed(ranks):
    got = ranks[0]["flip"]["rounds"][0]["scores"]
    want = transcribed_scores()
    assert got == pytest.approx(want, rel=1e-3, abs=1e-7), (got, want)
    assert want[2] < 0 < min(want[:2])


@pytest.mark.procs
def test_the_trainer_logs_each_round_on_the_step_that_scored_it_and_says_who_was_left_out(ranks):
    trained = ranks[0]["trained"]
    rounds = trained["summary"]["score_rounds"]
    on_steps = [(r["step"], k) for r in trained["steps"] for k in r.get("score_rounds", ())]
    assert [step for step, _ in on_steps] == list(range(1, STEPS + 1, EVERY))  # optimizer steps 0, 2, ...
    assert [{k: v for k, v in entry.items() if not k.startswith("score_s")} for _, entry in on_steps] == rounds
    said = [f"round {k['round']}: {e}" for k in rounds for e in k["events"] if "left out: its score" in e]
    assert said and rounds[-1]["left_out"] == [2], rounds
    for text in said:
        assert any(text in line for line in trained["shown"].splitlines()), (text, trained["shown"])
    assert ranks[1]["trained"]["shown"] == ranks[2]["trained"]["shown"] == ""

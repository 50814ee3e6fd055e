"""--score's rounds where a user reads them, and --validators.

- steps.jsonl: each scored round on the record of the step whose outer step took it (the final
  sync's on the last step), the same rounds as summary.json's score_rounds, with the seconds of
  scoring work; a run resumed from a mid-run checkpoint keeps the history;
- the progress line says when a worker is left out;
- `lowcomm report` reads the rounds from steps.jsonl where the summary has none and sets each
  round's scoring seconds against its wall time;
- --validators 0: only worker 0 runs scoring forwards (counted), and a sign-flipping attacker is
  left out in the same rounds as with every worker scoring.

One W = 3 spawn runs it all: two driver runs (every worker validating, and worker 0 alone) and a
trained run through the trainer, straight and resumed."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import lowcomm
from lowcomm.cli.main import build_parser, config_from_args, main
from lowcomm.comm.wire import wire_bytes
from lowcomm.robust.scoring import scorers, standing_changes
from lowcomm.run.driver import make_run
from lowcomm.train.outputs import ScoreRounds

from dist_utils import run_dist
from local_sgd import SEQ, make_model

W, STEPS, H = 3, 12, 3
SCORE_S = ("score_s", "score_s_per_rank")


def counting_batch(step: int, rank: int):
    """Sequences counting up by one (mod 64) from a random start: learned in a few steps, so a
    flipped update shows in the loss."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    seq = (torch.arange(SEQ + 1) + torch.randint(0, 64, (4, 1), generator=g)) % 64
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _driver_run(rank: int, validators: str) -> dict:
    """A scored diloco run with a sign-flipper on rank 2: its rounds, this rank's forwards
    outside training (the scoring's: nothing else runs one without gradients here) and the
    bookkeeping collectives its scoring sent (counted around each sync's `admit`)."""
    torch.manual_seed(0)
    model = make_model()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1) if not torch.is_grad_enabled() else None)
    run = make_run("diloco", model, lowcomm.Comm(), lambda p: torch.optim.AdamW(p, lr=1e-2), total_steps=STEPS,
                   sync_every=H, score=True, attack="sign-flip", attackers="2", validators=validators)
    wire, sent = run.strategy.sync.wire, []
    wire.admit = counted(wire.admit, run.comm, sent)
    for _ in range(STEPS):
        step = run.steps_done
        run.step(lambda: counting_batch(step, rank), lowcomm.lm_loss)
    run.close()
    return {"rounds": run.strategy.report()["score_rounds"], "forwards": len(forwards), "meta": sent}


def counted(admit, comm, sent: list):
    """`admit`, noting the bookkeeping ops and bytes each call sends on `comm`."""
    def admit_counting(*args):
        before = comm.meta.copy()
        keep = admit(*args)
        sent.append((comm.meta.ops - before.ops, comm.meta.wire_bytes - before.wire_bytes))
        return keep
    return admit_counting


STREAMING = ("--strategy", "streaming_diloco", "--fragments", "3", "--fragment-delay", "1", "--n-layer", "3")


def trainer_argv(data: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--strategy", "diloco", "--workers", str(W), "--steps", str(STEPS), "--sync-every", str(H),
            "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--micro-batch", "4",
            "--eval-every", "0", "--eval-batches", "1", "--log-every", "5", "--checkpoint-every", "6",
            "--score", "--score-patience", "1", "--validators", "0", "--attack", "scale:-100", "--attackers", "2",
            "--data", data, "--out", str(out), *extra]


def _trained(rank: int, data: str, out: Path, resume: bool, *extra: str) -> str:
    """The trainer's run, summary.json included (its progress lines on rank 0), or the same run
    resumed from its step-6 checkpoint."""
    from lowcomm import checkpoint
    from lowcomm import config as C
    from lowcomm.train.worker import train
    cfg = config_from_args(build_parser().parse_args(trainer_argv(data, out, *extra)))
    C.validate(cfg)
    if resume:
        cfg.resume_from = str(out / checkpoint.name_of(6))
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        train(cfg, rank, W, 0, out if rank == 0 else None, quiet=resume)
    return shown.getvalue()


def _logged(out: Path) -> dict:
    return {"steps": [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()],
            "summary": json.loads((out / "summary.json").read_text())}


def _all(rank: int, world: int, data: str, root: str) -> dict:
    out = Path(root) / "scored"  # made by the test, as `lowcomm train` makes it before its workers start
    results = {v or "all": _driver_run(rank, v) for v in ("", "0")}
    results["shown"] = _trained(rank, data, out, resume=False)
    if rank == 0:
        results["straight"] = _logged(out)
    _trained(rank, data, out, resume=True)
    _trained(rank, data, out.with_name("streaming"), False, *STREAMING)
    if rank == 0:
        results["resumed"], results["streaming"] = _logged(out), _logged(out.with_name("streaming"))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("scored")
    (root / "scored").mkdir()
    (root / "streaming").mkdir()
    data = root / "text.txt"
    data.write_text("It is a truth universally acknowledged, that a single man in possession of a good "
                    "fortune, must be in want of a wife.\n" * 60)
    return run_dist(_all, W, str(data), str(root), timeout=600)


def without_seconds(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in SCORE_S}


@pytest.mark.procs
def test_only_the_validators_score_and_they_leave_out_the_same_attacker(ranks):
    every, alone = ranks[0]["all"]["rounds"], ranks[0]["0"]["rounds"]
    assert len(every) == STEPS // H
    assert [k["left_out"] for k in alone] == [k["left_out"] for k in every] == [[], [], [2], [2]]
    for k_all, k_alone in zip(every, alone):
        assert k_alone["scores"][0] is None and k_alone["fits"][0] is None  # a lone validator's own: unscored
        assert k_alone["scores"][1:] == pytest.approx(k_all["scores"][1:], rel=1e-5, abs=1e-9)
    for r in range(W):  # every worker decided alike
        assert ranks[r]["0"]["rounds"] == alone and ranks[r]["all"]["rounds"] == every
    # every worker validating: per round 1 forward at θ_global (its batch's, shared: the next batch's
    # it reads from the table) and 2 at θ_global - 0.2·lr·Δ; worker 0 alone: every batch at θ_global
    # (3) and 2 for each of the 2 contributions it scores (7)
    assert [ranks[r]["all"]["forwards"] for r in range(W)] == [3 * len(every)] * W
    assert [ranks[r]["0"]["forwards"] for r in range(W)] == [7 * len(alone), 0, 0]


@pytest.mark.procs
def test_a_scored_sync_shares_the_held_sequences_in_one_gather_and_the_scores_in_one_reduce(ranks):
    """Per round, one all-gather of each worker's held shape and sequences (4 of SEQ tokens,
    int64, padded to --score-batches x the model's positions) and one all-reduce of the W x 4
    score table (float64), whoever validates."""
    gather, reduce = wire_bytes("all_gather", W * (2 + 4 * SEQ) * 8, W), wire_bytes("all_reduce", W * 4 * 8, W)
    for validators in ("all", "0"):
        rounds = len(ranks[0][validators]["rounds"])
        for r in range(W):
            assert ranks[r][validators]["meta"] == [(2, gather + reduce)] * rounds, (validators, r)


@pytest.mark.procs
def test_steps_jsonl_holds_the_summarys_rounds_on_their_steps(ranks):
    logged = ranks[0]["straight"]
    rounds = logged["summary"]["score_rounds"]
    on_steps = [(r["step"], k) for r in logged["steps"] for k in r.get("score_rounds", ())]
    assert [without_seconds(k) for _, k in on_steps] == rounds and len(rounds) == STEPS // H
    assert [step for step, _ in on_steps] == [3, 6, 9, 12]  # gathered at 5, 6, 10 and 12: each on its own step
    for _, k in on_steps:
        assert len(k["score_s_per_rank"]) == W and k["score_s"] == max(k["score_s_per_rank"]) > 0
    assert any(k["left_out"] == [2] for k in rounds), rounds  # scale:-100 is left out (patience 1)


@pytest.mark.procs
def test_a_streaming_run_logs_one_round_per_fragment_sync(ranks):
    """Fragment f of 3 syncs at t ≡ f (mod 3) and merges a step later; at step 12 the final sync
    merges fragment 2's sync of step 11 and then scores every fragment once more."""
    logged = ranks[0]["streaming"]
    on_steps = [(r["step"], k) for r in logged["steps"] for k in r.get("score_rounds", ())]
    assert [without_seconds(k) for _, k in on_steps] == logged["summary"]["score_rounds"]
    assert [step for step, _ in on_steps] == list(range(2, 12)) + [12] * 4
    assert all("score_s" in k for _, k in on_steps)


@pytest.mark.procs
def test_the_progress_line_says_who_was_left_out(ranks):
    rounds = ranks[0]["straight"]["summary"]["score_rounds"]
    said = [f"round {k['round']}: {e}" for k in rounds for e in k["events"] if "left out: its score" in e]
    assert said, rounds
    lines = ranks[0]["shown"].splitlines()
    for text in said:
        assert any(text in line for line in lines), (text, lines)
    assert ranks[1]["shown"] == ranks[2]["shown"] == ""


@pytest.mark.procs
def test_a_resumed_run_keeps_the_score_history(ranks):
    straight, resumed = ranks[0]["straight"], ranks[0]["resumed"]
    assert resumed["summary"]["score_rounds"] == straight["summary"]["score_rounds"]
    logged = [[without_seconds(k) for r in run["steps"] for k in r.get("score_rounds", ())]
              for run in (straight, resumed)]
    assert logged[1] == logged[0]
    assert [r["step"] for r in resumed["steps"]] == list(range(1, STEPS + 1))


def test_every_contribution_has_one_scorer_other_than_itself_rotating_by_round():
    for world in (2, 3, 5):
        for k in range(2 * world):
            every = scorers(world, tuple(range(world)), k)
            assert sorted(every) == list(range(world))  # one contribution a worker
            assert every == [(r + 1 + k % (world - 1)) % world for r in range(world)]
    assert scorers(3, (0,), 0) == [None, 0, 0]
    assert [scorers(4, (1, 3), k) for k in range(2)] == [[1, 3, 1, 1], [3, 3, 3, 1]]


@pytest.mark.parametrize("argv, said", [
    (["--validators", "0"], "--validators 0 needs --score: validators run the scoring"),
    (["--workers", "3", "--score", "--validators", "0,3"],
     "--validators 0,3: rank 3 is out of range for 3 workers (ranks 0 to 2)"),
    (["--workers", "1", "--score", "--validators", "0"],
     "--validators 0: the only worker would score only its own contribution, and no validator scores its own"),
])
def test_validators_that_make_no_sense_are_refused_in_one_line(tmp_path, data_file, capfd, argv, said):
    out = tmp_path / "run"
    assert main(["train", "--strategy", "diloco", *argv, "--data", str(data_file), "--out", str(out)]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [f"error: {said}"]
    assert not out.exists()


class FakeScoring:
    def __init__(self, rounds):
        self.rounds = rounds

    def rounds_from(self, first):
        return self.rounds[first:]

    standing_changes = staticmethod(lambda entry: standing_changes(entry, 2))


def test_rounds_land_on_their_steps_records_in_later_gathers_and_at_the_end():
    rounds = [(3, {"round": 0, "events": []}), (6, {"round": 1, "events": ["named in words"], "newly_left_out": [2]}),
              (None, {"round": 2, "events": []})]
    placing = ScoreRounds(FakeScoring(rounds[:2]), kept=[], end_step=8)
    first = [{"step": s} for s in (1, 2, 3, 4, 5)]
    assert placing.place(first) == [] and first[2]["score_rounds"] == [rounds[0][1]]
    assert all("score_rounds" not in r for i, r in enumerate(first) if i != 2)  # round 1 waits for step 6
    placing.scoring.rounds = rounds
    last = [{"step": s} for s in (6, 7, 8)]
    assert placing.place(last) == ["round 1: worker 2 left out: its score was negative for 2 rounds"]
    assert last[0]["score_rounds"] == [rounds[1][1]] and last[2]["score_rounds"] == [rounds[2][1]]
    resumed = ScoreRounds(FakeScoring(rounds), kept=first + last[:1], end_step=8)
    assert resumed.next == 2


def test_the_report_reads_rounds_from_steps_jsonl_and_prices_the_scoring(tmp_path):
    from lowcomm.bench.report.untrusted import section
    from lowcomm.metrics.runs import RecordedRun

    rounds = [{"round": 0, "scores": [None, 0.02, -0.01], "fits": [None, 1, -1], "left_out": [], "events": []},
              {"round": 1, "scores": [None, 0.01, -0.03], "fits": [None, 1, -1], "left_out": [2],
               "events": ["worker 2 left out: its score was negative for 2 rounds"]}]
    steps = [{"step": 1, "wall_s": 1.0}, {"step": 2, "wall_s": 1.0, "score_rounds": [{**rounds[0], "score_s": 0.1}]},
             {"step": 3, "wall_s": 0.5}, {"step": 4, "wall_s": 1.5, "score_rounds": [{**rounds[1], "score_s": 0.3}]}]
    killed = RecordedRun("diloco (killed)", tmp_path, {"aggregate": "mean"}, steps, {})
    text = section([killed])
    assert "**diloco (killed)**: Scoring left out worker 2 in 1 of 2 rounds (first at round 1)." in text
    assert "| 0 | – | +0.0200 | -0.0100 |  | 2 | 0.100 | 2.000 | 5.0 % |" in text
    assert "| 1 | – | +0.0100 | -0.0300 **out** | worker 2 left out: its score was negative for 2 rounds " \
           "| 4 | 0.300 | 2.000 | 15.0 % |" in text
    assert "Scoring took 0.400 s of the 4.000 s of wall time of the scored rounds' steps (10.0 %" in text
    assert "not met" in text

"""Checkpoints, exact resume, restarts and non-finite steps.

Every registered strategy, in two shared W=2 spawns (spawning is the expensive part):
- the first runs each strategy STEPS steps straight, writing checkpoints at step CKPT and at
  the end (the uninterrupted reference), and a short run with a NaN loss on rank 1;
- the second, a fresh process group, resumes each strategy from its step-CKPT checkpoint
  on disk and must end with bit-identical parameters and the same steps.jsonl losses.
One zero1 run in three parts: --stop-at (in the first spawn), then through the CLI a truncated
checkpoint refused and the previous one used by --resume, and --max-restarts after a worker
SIGKILLs itself; a checkpoint missing a rank's file is refused too.
Suite time is a budget: the whole file is 2 shared spawns and 2 CLI launches.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from lowcomm import checkpoint as K
from lowcomm.cli.main import build_parser, config_from_args, main
from lowcomm.errors import UsageError
from lowcomm.strategies import available, get
from lowcomm.strategies.registry import reproducible_flags

from dist_utils import run_dist
from tiny_runs import trained

pytestmark = pytest.mark.procs

STRATEGIES = available()
DATA = "pydoc"  # Python's own documentation topics: always installed, small
STEPS = 5
CKPT = 3      # the step resumed from: just before PowerSGD's first compressed step (the hard case)
NAN_STEPS, NAN_AT = 3, 2  # the NaN runs: rank 1's loss is NaN in step NAN_AT
# Options that make every strategy do its interesting part within STEPS steps: syncs, fragments
# in flight across the checkpoint, delayed updates, PowerSGD's compressed phase.
OPTIONS = {"dpu": ["--dpu-warmup", "1"], "powersgd": ["--powersgd-start", "3"],
           "diloco": ["--sync-every", "2"], "sparseloco": ["--sync-every", "2"],
           "streaming_diloco": ["--sync-every", "2", "--fragments", "2", "--fragment-delay", "1"]}
# How a NaN loss on one rank is skipped: a strategy with local inner steps (the DiLoCo family)
# skips that rank's inner step only; an overlapped one the rounds that carry the NaN's gradient:
# dpu's a step later; acco's real round of the same step (its estimate round's half) and the next
# step's two rounds (its real round's half, ∇θ̃); every other strategy the step itself, on every rank.
OVERLAPPED_SKIP = {"acco": {NAN_AT, NAN_AT + 1}, "dpu": {NAN_AT + 1}}


def argv(name: str, out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return ["train", "--strategy", name, "--workers", "2", "--steps", str(steps), "--n-layer", "1",
            "--n-head", "2", "--d-model", "16", "--seq-len", "32", "--micro-batch", "2", "--warmup", "1",
            "--eval-every", "0", "--eval-batches", "1", "--data", DATA, "--out", str(out), "--quiet",
            *reproducible_flags(name), *OPTIONS.get(name, []), *extra]


def config(name, out, *extra, steps=STEPS):
    from lowcomm import config as C
    cfg = config_from_args(build_parser().parse_args(argv(name, out, *extra, steps=steps)))
    C.validate(cfg)
    return cfg


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def saved_params(ckpt: Path, rank: int = 0) -> dict:
    """The model parameters a checkpoint holds for `rank` (from the strategy's state)."""
    return K.read_state(K.read(ckpt), rank)["strategy"]["parts"]["model"]


def _train(cfg, rank, world):
    return flat(trained(cfg, rank, world).model)


def _straight_life(rank, world, names, root):
    out = {}
    for name in names:
        cfg = config(name, Path(root) / name, "--checkpoint-every", str(CKPT))
        params = _train(cfg, rank, world)
        out[name] = {"params": params, "records": records(Path(cfg.out)) if rank == 0 else None}
        os.environ["LOWCOMM_TEST_NAN_AT"] = f"1:{NAN_AT}"
        try:
            cfg = config(name, Path(root) / f"nan-{name}", steps=NAN_STEPS)
            params = _train(cfg, rank, world)
        finally:
            del os.environ["LOWCOMM_TEST_NAN_AT"]
        out[f"nan-{name}"] = {"params": params, "records": records(Path(cfg.out)) if rank == 0 else None}
    _train(config(*stopped_zero1(Path(root) / "stopped")), rank, world)
    return out


def stopped_zero1(out):
    """The first part of the CLI test's run, trained here to share this spawn: --stop-at 3."""
    return ("zero1", out, "--checkpoint-every", "1", "--keep", "3", "--stop-at", "3")


def _resumed_life(rank, world, names, root):
    out = {}
    for name in names:
        cfg = config(name, Path(root) / name, "--checkpoint-every", str(CKPT))
        cfg.resume_from = str(Path(root) / name / K.name_of(CKPT))
        params = _train(cfg, rank, world)
        out[name] = {"params": params, "records": records(Path(cfg.out)) if rank == 0 else None}
    return out


@pytest.fixture(scope="module")
def lives(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name in STRATEGIES:
        (root / name).mkdir()
        (root / f"nan-{name}").mkdir()
    from lowcomm import config as C
    (root / "stopped").mkdir()  # what `lowcomm train --stop-at 3 ...` writes before it trains
    (root / "stopped" / "config.toml").write_text(C.to_toml(config(*stopped_zero1(root / "stopped"))))
    straight = run_dist(_straight_life, 2, STRATEGIES, str(root), timeout=600)
    straight_records = {name: list(straight[0][name]["records"]) for name in STRATEGIES}
    resumed = run_dist(_resumed_life, 2, STRATEGIES, str(root), timeout=600)
    return straight, straight_records, resumed, root


@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_from_a_checkpoint_is_bit_identical(name, lives):
    straight, straight_records, resumed, root = lives
    for rank in range(2):
        a, b = straight[rank][name]["params"], resumed[rank][name]["params"]
        assert torch.equal(a, b), f"rank {rank}: parameters after resuming differ by {float((a - b).abs().max()):.3g}"
    before, after = straight_records[name], resumed[0][name]["records"]
    assert [r["step"] for r in after] == list(range(1, STEPS + 1))  # nothing missing or written twice
    assert [r["loss"] for r in after] == [r["loss"] for r in before]
    assert sorted(p.name for p in root.joinpath(name).glob("ckpt-*")) == [K.name_of(CKPT), K.name_of(STEPS)]


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_nan_loss_on_one_rank_is_skipped_and_reported(name, lives):
    straight = lives[0]
    recs = straight[0][f"nan-{name}"]["records"]
    assert [r["step"] for r in recs] == list(range(1, NAN_STEPS + 1))
    assert math.isnan(recs[NAN_AT - 1]["loss"])  # as rank 1 computed it
    skipped = {r["step"]: r["skipped_ranks"] for r in recs if "skipped_ranks" in r}
    from lowcomm.strategies.diloco import DiLoCo
    if issubclass(get(name), DiLoCo):
        assert skipped == {NAN_AT: [1]}, skipped
    elif name in OVERLAPPED_SKIP:
        assert set(skipped) == OVERLAPPED_SKIP[name] and all(v == [0, 1] for v in skipped.values()), skipped
    else:
        assert skipped == {NAN_AT: [0, 1]}, skipped
    assert math.isfinite(recs[-1]["loss"])
    p0, p1 = (straight[r][f"nan-{name}"]["params"] for r in range(2))
    assert torch.isfinite(p0).all() and torch.equal(p0, p1)


@pytest.mark.faults
def test_stop_at_resume_refusals_and_restart(lives, tmp_path, monkeypatch, capsys):
    """One run in three parts (zero1): --stop-at 3 ends cleanly with checkpoints 1-3 (trained in the
    shared spawn, `lives`); the newest is then truncated, so `--resume` refuses it in one line and continues from step 2; rank 1 then
    SIGKILLs itself after step 4 and --max-restarts relaunches both workers from the checkpoint of
    step 3. The run ends with the uninterrupted run's parameters and losses, every step logged
    once. A checkpoint missing a rank's file is refused too; another world size takes the same
    checkpoint (its sharded state re-cut)."""
    straight_records, root = lives[1], lives[3]
    out = tmp_path / "run"
    shutil.copytree(root / "stopped", out)
    assert sorted(p.name for p in out.glob("ckpt-*")) == ["ckpt-000001", "ckpt-000002", "ckpt-000003"]
    assert [r["step"] for r in records(out)] == [1, 2, 3]
    victim = out / "ckpt-000003" / "__1_0.distcp"
    full = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: full // 2])
    capsys.readouterr()

    monkeypatch.setenv("LOWCOMM_TEST_KILL_AT", "1:4")
    assert main(["train", "--resume", str(out), "--max-restarts", "1", "--quiet"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    refused = [line for line in err if "refused" in line]
    assert len(refused) == 1 and refused[0] == (
        f"warning: checkpoint {out / 'ckpt-000003'} refused: file __1_0.distcp has "
        f"{full // 2} bytes, its manifest says {full} (truncated?); "
        f"trying the previous one"), err
    assert f"lowcomm: resuming from {out / 'ckpt-000002'} (step 2 of {STEPS})" in err, err  # the one it took
    assert any("worker rank 1 failed: killed by signal SIGKILL; restart 1 of 1 from ckpt-000003 (step 3)" in line
               for line in err), err
    restarts = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["resume_step"]) for r in restarts] == [(1, 3)]

    assert [r["step"] for r in records(out)] == list(range(1, STEPS + 1))  # none missing, none twice
    assert [r["loss"] for r in records(out)] == [r["loss"] for r in straight_records["zero1"]]
    reference = root / "zero1" / K.name_of(STEPS)
    for rank in range(2):
        mine, ref = saved_params(out / K.name_of(STEPS), rank), saved_params(reference, rank)
        assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert json.loads((out / "summary.json").read_text())["steps"] == STEPS

    (out / K.name_of(STEPS) / "__1_0.distcp").unlink()
    cfg, warned = config("zero1", out), []
    found = K.latest(out, cfg, 2, warn=warned.append)
    assert found.step == STEPS - 1 and warned == [f"warning: checkpoint {out / K.name_of(STEPS)} refused: file "
                                                  f"__1_0.distcp is missing; trying the previous one"]
    assert K.latest(out, cfg, 3, warn=warned.append) == found  # re-cut for 3 (test_resume_other_world.py)


def test_min_workers_may_change_on_resume_and_a_checkpoint_hashed_with_it_is_still_taken():
    """An elastic run resumes on the workers it finds, so --min-workers (what its quorums need)
    may change with --resume; a checkpoint written when the hash still held it is still taken."""
    from lowcomm import config as C
    from lowcomm.checkpoint.layout import FORMERLY_HASHED, SAFE_KEYS, config_hash, config_hashes
    two, one = (C.RunConfig(elastic=True, workers=3, min_workers=m) for m in (2, 1))
    assert "min_workers" in SAFE_KEYS and config_hash(two) == config_hash(one)
    older = config_hash(two, FORMERLY_HASHED)  # what a checkpoint of this run carried before
    assert older != config_hash(two) and older in config_hashes(two)
    assert config_hash(C.RunConfig(elastic=True, workers=3, min_workers=2, seed=7)) not in config_hashes(two)


def test_a_checkpoint_of_the_format_before_named_state_parts_is_refused_in_one_line(tmp_path, capsys):
    """Format 1 held the strategy's state by position ("model", "optimizers", "extra"); today's
    holds it by the parts the strategy declares (contract/parts.py). `--resume` of a run whose only
    checkpoints are of format 1 ends in one line naming that format, before any worker starts (the
    older ones are of that format too: no warning for each)."""
    from lowcomm import config as C
    from tiny_runs import error_line
    out = tmp_path / "run"
    ckpt = out / K.name_of(3)
    out.mkdir()
    cfg = config("zero1", out)
    (out / "config.toml").write_text(C.to_toml(cfg))
    for step in (1, 3):
        (out / K.name_of(step)).mkdir()
        (out / K.name_of(step) / K.MANIFEST).write_text(json.dumps(
            {"format": 1, "step": step, "strategy": "zero1", "world": 2, "config_hash": K.config_hash(cfg), "files": {}}))
    with pytest.raises(UsageError) as refused:
        K.verify(ckpt, cfg, 2)
    assert str(refused.value).startswith("it is in checkpoint format 1, written by an older lowcomm; this version "
                                         f"reads format {K.FORMAT}")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    line = error_line(err)
    assert line.startswith(f"error: no usable checkpoint in {out} (newest: {ckpt}: it is in checkpoint format 1, "), line
    assert "warning" not in err, err
    assert K.FORMAT == 2

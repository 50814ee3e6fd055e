"""Checkpoints and --resume of an elastic run: checkpoints are written at commit points by the
members of the time; `lowcomm train --resume` continues the run bit for bit with as many workers
as wrote the checkpoint, and with the workers it is started with otherwise (here 3 after 2,
stopped again with --stop-at), for ddp, zero1 (its shards put together and cut anew) and
sparseloco (a worker's own residual: the third worker's starts at zero); a strategy whose commit
points fall between the multiples of --checkpoint-every (streaming_diloco) checkpoints at the
first commit point after each.

With replica groups (a launcher's slot of 2 processes is one replica) the same holds position by
position: zero1 across 2 replicas equals the plain run, resumes bit for bit, goes on with 1
replica from a checkpoint of 2 and with 2 again when `lowcomm join` adds one; diloco and zero1 with
FSDP inside heal a restarted replica shard by shard, and their checkpoints resume bit for bit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli.main import main  # noqa: E402
from elastic_runs import TINY, check_finished, checkpoint_params_hashes, join_once, jsonl, wait_for  # noqa: E402

pytestmark = pytest.mark.elastic

STEPS = 12


def lowcomm(capfd, *args: str) -> tuple[str, str]:
    """The command in this process (its launcher's imports done once: the workers' fork server
    stays warm across the three launches); the launcher's (stdout, stderr)."""
    assert main(list(args)) == 0, capfd.readouterr().err
    return capfd.readouterr()


def stopped_after_4(run: Path, copy: Path) -> Path:
    """A copy of `run` as a run stopped after step 4 would have left it."""
    shutil.copytree(run, copy)
    for later in ("ckpt-000008", "ckpt-000012"):
        shutil.rmtree(copy / later)
    (copy / "summary.json").unlink()
    return copy


def whole_state_hash(checkpoint: Path, strategy: str) -> str:
    """The hash of the state every member must hold, read from a checkpoint's files here: zero1's
    moments and master copy joined from the ranks' shards in rank order (cut to the model's size);
    which parts are replicated, as the strategy declares them (a one-process run of it tells)."""
    import lowcomm
    from lowcomm.checkpoint import read, read_state
    from lowcomm.contract.parts import replicated_tensors
    from lowcomm.elastic.transfer import state_hash
    from lowcomm.run.driver import make_run

    found = read(checkpoint)
    states = [read_state(found, r)["strategy"] for r in range(found.world)]
    state = states[0]
    parts = state["parts"]
    if strategy == "zero1":
        numel = sum(v.numel() for k, v in parts["model"].items())
        for k, v in parts["optimizer"]["state"][0].items():
            if getattr(v, "dim", lambda: 0)() == 1:
                v.data = torch.cat([st["parts"]["optimizer"]["state"][0][k] for st in states])[:numel]
        if parts["master"] is not None:
            parts["master"] = torch.cat([st["parts"]["master"] for st in states])[:numel]
    declared = make_run(strategy, lowcomm.GPT(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=8),
                        lowcomm.Comm(), torch.optim.AdamW)
    try:
        return state_hash(replicated_tensors(declared.strategy.state_parts(), state))
    finally:
        declared.close()


@pytest.mark.parametrize("flags", [["ddp"], ["zero1"], ["sparseloco", "--sync-every", "4"]],
                         ids=["ddp", "zero1", "sparseloco"])
def test_an_elastic_run_resumes_bit_for_bit_and_with_the_workers_it_finds(flags, tmp_path, capfd, monkeypatch):
    # sparseloco: each worker's error-feedback residual is its own; the third worker starts it at zero
    strategy = flags[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    whole = tmp_path / "whole"
    lowcomm(capfd, "train", *TINY, "--workers", "2", "--strategy", *flags, "--steps", str(STEPS), "--checkpoint-every", "4",
            "--keep", "3", "--out", str(whole))
    assert sorted(p.name for p in whole.glob("ckpt-*")) == ["ckpt-000004", "ckpt-000008", "ckpt-000012"]
    assert json.loads((whole / "ckpt-000008" / "manifest.json").read_text())["world"] == 2
    _, uninterrupted = check_finished(whole, STEPS)

    # The same number of workers: the same parameters as the run that never stopped.
    resumed = stopped_after_4(whole, tmp_path / "resumed")
    lowcomm(capfd, "train", "--resume", str(resumed), "--quiet")
    _, summary = check_finished(resumed, STEPS)  # steps 1-12, each once
    assert summary["elastic"]["final_params_sha256"] == uninterrupted["elastic"]["final_params_sha256"]
    assert [q["step"] for q in jsonl(resumed / "membership.jsonl")] == [0, 4]

    # Three workers: the run goes on with them from step 4, and stops at 8 with their checkpoint.
    more = stopped_after_4(whole, tmp_path / "more")
    # (the launcher's lines only: the workers print to where the fork server was started, an
    # earlier test's capture when one started it)
    _, err = lowcomm(capfd, "train", "--resume", str(more), "--workers", "3", "--stop-at", "8")
    assert "written by 2 workers, resuming on 3" in err
    join = jsonl(more / "membership.jsonl")[-1]
    assert join["step"] == 4 and join["slots"] == [0, 1, 2] and len(set(join["state_sha256"])) == 1
    # every member resumed from the state the two workers saved (zero1's: two shards, cut in three)
    assert set(join["resumed_sha256"]) == {whole_state_hash(whole / "ckpt-000004", strategy)}, join
    assert [r["members"] for r in jsonl(more / "steps.jsonl")] == [[0, 1]] * 4 + [[0, 1, 2]] * 4  # to 8 only
    assert json.loads((more / "ckpt-000008" / "manifest.json").read_text())["world"] == 3
    assert not (more / "summary.json").exists()  # a part of the run: the part that reaches --steps writes it


def test_checkpoints_fall_on_the_first_commit_point_after_each_multiple_and_resume_bit_for_bit(
        tmp_path, capfd, monkeypatch):
    # streaming_diloco's members agree only at its fragments' merges (H=4, 2 fragments merged a
    # step after their syncs: steps 3, 5, 7, 9, 11), never on a multiple of 4: --checkpoint-every 4
    # writes at 5 and 9, and at the end.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    flags = ["--strategy", "streaming_diloco", "--sync-every", "4", "--fragments", "2", "--fragment-delay", "1"]
    whole = tmp_path / "whole"
    lowcomm(capfd, "train", *TINY, "--workers", "2", *flags, "--steps", str(STEPS), "--checkpoint-every", "4",
            "--keep", "3", "--out", str(whole))
    assert sorted(p.name for p in whole.glob("ckpt-*")) == ["ckpt-000005", "ckpt-000009", "ckpt-000012"]
    _, uninterrupted = check_finished(whole, STEPS)
    resumed = tmp_path / "resumed"  # as a run stopped after step 5 would have left it
    shutil.copytree(whole, resumed)
    for later in ("ckpt-000009", "ckpt-000012", "summary.json"):
        shutil.rmtree(resumed / later) if later.startswith("ckpt") else (resumed / later).unlink()
    lowcomm(capfd, "train", "--resume", str(resumed), "--quiet")
    _, summary = check_finished(resumed, STEPS)
    assert summary["elastic"]["final_params_sha256"] == uninterrupted["elastic"]["final_params_sha256"]
    assert [q["step"] for q in jsonl(resumed / "membership.jsonl")] == [0, 5]


def test_a_signalled_elastic_run_checkpoints_at_its_next_commit_point_and_resumes(tmp_path):
    # What a preempted batch job does: SIGTERM to the launcher alone. With --checkpoint-on-signal the
    # members write a checkpoint at their next commit point (diloco: an outer sync) and stop cleanly;
    # the launcher says so, and the run resumes from it with every step logged once.
    out, every = tmp_path / "run", 4
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", "train", *TINY, "--workers", "2", "--strategy", "diloco", "--sync-every",
         str(every), "--schedule", "constant", "--warmup", "0", "--steps", "100000", "--checkpoint-on-signal",
         "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own session: the signal reaches the launcher alone
    try:
        wait_for(lambda: (out / "steps.jsonl").exists() and (out / "steps.jsonl").stat().st_size, "a step")
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert ("interrupted by SIGTERM: every worker stopped; the workers wrote a checkpoint first"
            in err.strip().splitlines()[-1]), err
    last = len(jsonl(out / "steps.jsonl"))
    assert last % every == 0 and sorted(p.name for p in out.glob("ckpt-*"))[-1] == f"ckpt-{last:06d}"
    assert main(["train", "--resume", str(out), "--steps", str(last + every), "--quiet"]) == 0
    check_finished(out, last + every)


# -- replica groups: a launcher's slot of K = 2 processes is one replica -----------------------------

REPLICAS = ["--elastic", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "16", "--data", "pydoc",
            "--eval-every", "0", "--quiet", "--steps", str(STEPS)]
TWO, ONE = ["--workers", "4", "--replicas", "2"], ["--workers", "2", "--replicas", "1"]


def quorum_at(run: Path, step: int) -> dict:
    return next(q for q in jsonl(run / "membership.jsonl") if q["step"] == step)


def test_zero1_across_elastic_replicas_equals_the_plain_run_and_goes_on_with_the_replicas_it_finds(
        tmp_path, capfd, monkeypatch):
    # zero1's optimizer state is sharded across the replicas at each position: gathered at every
    # commit, put together from a checkpoint's shards of that position and cut anew for one replica,
    # and cut for two again when `lowcomm join` adds a replica that takes the live state
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plain, whole = tmp_path / "plain", tmp_path / "whole"
    flags = ["--strategy", "zero1", *TWO]
    lowcomm(capfd, "train", *REPLICAS[1:], *flags, "--checkpoint-every", str(STEPS), "--out", str(plain))
    lowcomm(capfd, "train", *REPLICAS, *flags, "--checkpoint-every", "4", "--keep", "3", "--out", str(whole))
    _, uninterrupted = check_finished(whole, STEPS)  # one model: --inside ddp shares the owners' tensors
    assert [r["loss"] for r in jsonl(whole / "steps.jsonl")] == [r["loss"] for r in jsonl(plain / "steps.jsonl")]
    assert uninterrupted["elastic"]["final_params_sha256"] == checkpoint_params_hashes(plain / f"ckpt-{STEPS:06d}")
    written = {p.name: p.stat().st_mtime_ns for p in whole.iterdir()}
    assert main(["train", "--resume", str(whole), "--workers", "6"]) == 2  # replicas of 3: refused, nothing written
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"error: --resume: {whole}/ckpt-000012 was written by replicas of 2 process(es), which a resumed elastic run "
        f"keeps (each process holds its position's state); this run has --workers 6 --replicas 2, replicas of 3: "
        f"pass --replicas 3")
    assert {p.name: p.stat().st_mtime_ns for p in whole.iterdir()} == written

    resumed = stopped_after_4(whole, tmp_path / "resumed")  # the same replicas: bit for bit
    lowcomm(capfd, "train", "--resume", str(resumed), "--quiet")
    _, summary = check_finished(resumed, STEPS)
    assert summary["elastic"]["final_params_sha256"] == uninterrupted["elastic"]["final_params_sha256"]
    held = quorum_at(resumed, 4)["state_sha256"]  # each position's state, as two replicas hold it at step 4
    assert held[:2] == held[2:] and held[0] != held[1]

    fewer = stopped_after_4(whole, tmp_path / "fewer")  # one replica from step 4, stopped at 8
    _, err = lowcomm(capfd, "train", "--resume", str(fewer), *ONE, "--stop-at", "8")
    assert "written by 2 replica(s) of 2 processes, resuming on 1" in err
    alone = quorum_at(fewer, 4)
    assert alone["slots"] == [0, 1] and alone["resumed_sha256"] == held[:2]  # two positions' shards, cut for one
    assert json.loads((fewer / "ckpt-000008" / "manifest.json").read_text())["world"] == 2

    # Resumed again on that replica, joined by one more from `lowcomm join` (the members hold at step 10
    # until it is in: a fresh python's start takes seconds), which takes each position's state live.
    monkeypatch.setenv("LOWCOMM_TEST_HOLD_FOR_REPLICAS", "2:10")
    thread, joiner = join_once(fewer, lambda: (fewer / "elastic.json").exists())  # once its launcher is up
    lowcomm(capfd, "train", "--resume", str(fewer), "--quiet")
    thread.join()
    out, err = joiner[0].communicate(timeout=60)
    assert joiner[0].returncode == 0, err
    records, summary = check_finished(fewer, STEPS)
    join = next(q for q in jsonl(fewer / "membership.jsonl") if q["healed"])
    assert join["slots"] == [0, 1, 2, 3] and join["healed"] == [2, 3] and join["replicas"][1].startswith("00001:")
    assert join["state_sha256"][:2] == join["state_sha256"][2:] == join["resumed_sha256"][:2]
    assert f"replica 1 trained steps {join['step'] + 1} to {STEPS} of the run in {fewer} (it has finished)" in out
    assert [len(r["members"]) for r in records] == [4] * 4 + [2] * (join["step"] - 4) + [4] * (STEPS - join["step"])


# With FSDP inside: diloco (its outer state on each position's shards), and zero1 (its optimizer
# state sharded across the replicas at each position, on the shards each position owns). The
# other strategies that run with FSDP inside keep their cross-replica state as one of these does.
@pytest.mark.parametrize("strategy", [["diloco", "--sync-every", "4"], ["zero1"]], ids=lambda s: s[0])
def test_a_replica_with_fsdp_inside_heals_position_by_position_and_its_checkpoint_resumes_bit_for_bit(
        strategy, tmp_path, capfd, monkeypatch):
    # FSDP inside each replica of 2: a process holds its shard of every tensor; slot 1's process 1
    # (rank 3) is killed after step 5 (diloco: mid-round), and its replica restarted as a joiner
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOWCOMM_TEST_KILL_AT", "3:5")
    run = tmp_path / "run"
    flags = ["--strategy", *strategy, *TWO, "--inside", "fsdp"]
    _, err = lowcomm(capfd, "train", *REPLICAS, *flags, "--checkpoint-every", "4", "--keep", "3", "--max-restarts", "1",
                     "--out", str(run))
    monkeypatch.delenv("LOWCOMM_TEST_KILL_AT")
    assert "replica 1 (process 1) failed: killed by signal SIGKILL" in err
    records = jsonl(run / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    healed = jsonl(run / "membership.jsonl")[-1]  # at the commit (diloco: the sync) that found rank 3 gone
    assert healed["healed"] == [2, 3] and healed["committed"][2:] == [-1, -1]
    shards = healed["state_sha256"]  # position p of the new replica holds position p's shards, bit for bit
    assert shards[2:] == shards[:2] == healed["resumed_sha256"][:2] and shards[0] != shards[1]
    final = json.loads((run / "summary.json").read_text())["elastic"]["final_params_sha256"]
    assert final[:2] == final[2:] and final[0] != final[1]

    resumed = tmp_path / "resumed"  # stopped after step 8 (written after the heal): the same replicas go on
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "ckpt-000012")
    (resumed / "summary.json").unlink()
    lowcomm(capfd, "train", "--resume", str(resumed), "--quiet")
    assert [r["step"] for r in jsonl(resumed / "steps.jsonl")] == list(range(1, STEPS + 1))
    assert json.loads((resumed / "summary.json").read_text())["elastic"]["final_params_sha256"] == final

"""--elastic under torchrun, as a user meets it: two torchrun jobs of K=2 processes against one
lighthouse are two replicas of one run. Both finish on equal parameters (all four processes,
by hash); each step is logged once; the steps both replicas trained equal, loss for loss, a
plain `--workers 4 --replicas 2` run's; when one process of job b is SIGKILLed, job a goes on
alone and torchrun restarts job b, which joins as a new replica with the live state (its hash
equal to job a's, position by position). The launcher's own replica slots (`--elastic --replicas
2`) do the same on one machine: a slot whose process died restarts as a whole.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli.main import main  # noqa: E402
from test_elastic import jsonl  # noqa: E402

# Job b's process 1 is killed after step KILL; job a, alone from there, holds at its first commit
# point past HOLD until the restarted job b is back (a test-only hook: a restart, two fresh
# pythons importing torch, takes 5 to 20 s with the machine's load).
STEPS, KILL, HOLD = 20, 4, 10
EVERY = 4  # the torchrun jobs checkpoint every 4 steps, beside the records (the --out of the lead job)
MODEL = ["--strategy", "ddp", "--steps", str(STEPS), "--n-layer", "2", "--n-head", "2", "--d-model", "16",
         "--seq-len", "16", "--data", "pydoc", "--eval-every", "0", "--quiet"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(out: Path, lighthouse: str, **faults: str) -> subprocess.Popen:
    """One replica: a torchrun job of 2 processes on its own rendezvous port (not --standalone,
    which would pick one torchrun prints nowhere), restarted once when a process dies; its
    output in OUT.log (a pipe nobody reads while the jobs run could fill and block them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **{f"LOWCOMM_TEST_{k.upper()}": v for k, v in faults.items()}}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "-m", "lowcomm", "train", "--elastic", "--lighthouse", lighthouse, "--min-workers", "2", *MODEL,
            "--checkpoint-every", str(EVERY), "--keep", str(STEPS // EVERY), "--out", str(out)]
    with open(f"{out}.log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def merged(outs: list[Path], name: str, key: str) -> list[dict]:
    """A jsonl file of the run: each part is in the --out of the job whose process was rank 0 then."""
    return sorted((r for out in outs if (out / name).exists() for r in jsonl(out / name)), key=lambda r: r[key])


def launcher_replicas(out: Path) -> str:
    """`lowcomm train --elastic --workers 4 --replicas 2`, slot 1's process 1 SIGKILLed after step
    KILL (slot·K + rank 3); returns its stderr."""
    faults = {"LOWCOMM_TEST_KILL_AT": f"3:{KILL}", "LOWCOMM_TEST_KILL_LOG": f"{out}.killed"}
    os.environ.update(faults)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["train", "--elastic", "--workers", "4", "--replicas", "2", "--max-restarts", "1", *MODEL,
                         "--out", str(out)]) == 0, err.getvalue()
    finally:
        for k in faults:
            os.environ.pop(k)
    return err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from lowcomm.elastic.lighthouse import start
    root = tmp_path_factory.mktemp("replicas")
    plain, outs, killed = root / "plain", [root / "a", root / "b"], root / "killed"
    server = start(1)
    try:
        address = server.address().replace("http://", "")
        a = torchrun(outs[0], address, hold_for_replicas=f"2:{HOLD}")
        b = torchrun(outs[1], address, kill_at=f"1:{KILL}", kill_log=str(killed))
        # while the jobs start (their pythons import torch): the plain run, and the launcher's own
        # replicas (a slot of 2 processes), its slot 1's process 1 killed after step KILL
        assert main(["train", "--workers", "4", "--replicas", "2", *MODEL, "--out", str(plain)]) == 0
        launched = launcher_replicas(root / "launched")
        for job in (a, b):
            job.wait(timeout=150)
    finally:
        for job in (a, b):
            job.kill()
        server.shutdown()
    return {"rc": [a.returncode, b.returncode], "err": [Path(f"{o}.log").read_text() for o in outs], "outs": outs,
            "plain": plain, "launched": launched,
            "killed": float(killed.read_text()), "steps": merged(outs, "steps.jsonl", "step"),
            "quorums": merged(outs, "membership.jsonl", "time")}


@pytest.mark.elastic
def test_two_torchrun_jobs_finish_as_replicas_on_equal_parameters_each_step_once(run):
    assert run["rc"] == [0, 0], run["err"]
    assert [r["step"] for r in run["steps"]] == list(range(1, STEPS + 1))
    summary = [json.loads((o / "summary.json").read_text()) for o in run["outs"] if (o / "summary.json").exists()]
    assert len(summary) == 1  # written by the job holding rank 0 at the end
    lead = next(i for i, o in enumerate(run["outs"]) if (o / "summary.json").exists())
    other = run["outs"][1 - lead]
    assert f"lowcomm: results in {run['outs'][lead]}" in run["err"][lead]
    assert (f"lowcomm: the run's records are in {run['outs'][lead].resolve()} on {socket.gethostname()} (the --out "
            f"of the job that led it at its end); this job's {other} holds its config.toml") in run["err"][1 - lead]
    hashes = summary[0]["elastic"]["final_params_sha256"]
    assert len(hashes) == 4 and len(set(hashes)) == 1, hashes


@pytest.mark.elastic
def test_steps_of_both_replicas_equal_a_plain_replicas_run(run):
    both = [r for r in run["steps"] if len(r["members"]) == 4 and r["step"] < KILL]
    assert [r["step"] for r in both] == list(range(1, KILL))  # the first quorum held both (--min-workers 2)
    plain = {r["step"]: r for r in jsonl(run["plain"] / "steps.jsonl")}
    for r in both:  # same data shards, same groups: bit for bit
        assert (r["loss"], r["tokens"], r["wire_bytes"]) == (plain[r["step"]]["loss"], plain[r["step"]]["tokens"],
                                                             plain[r["step"]]["wire_bytes"]), r["step"]


@pytest.mark.elastic
def test_a_killed_process_restarts_its_replica_which_joins_with_the_live_state(run):
    assert "exitcode: -9" in run["err"][1] and "local_rank: 1" in run["err"][1]  # torchrun saw it, restarted
    first, rejoined = run["quorums"][0], run["quorums"][-1]
    alone = next(q for q in run["quorums"] if len(q["replicas"]) == 1)
    assert len(first["replicas"]) == 2 and len(alone["replicas"]) == 1 and len(rejoined["replicas"]) == 2
    survivor = alone["replicas"][0]
    new = [r for r in rejoined["replicas"] if r not in first["replicas"]]
    assert len(new) == 1 and survivor in rejoined["replicas"]
    i, j = rejoined["replicas"].index(new[0]) * 2, rejoined["replicas"].index(survivor) * 2
    assert rejoined["healed"] == rejoined["slots"][i:i + 2] and rejoined["committed"][i] == -1
    # the joiner's state, position by position, equals the survivor's at its first step
    assert rejoined["state_sha256"][i:i + 2] == rejoined["state_sha256"][j:j + 2]
    assert rejoined["state_sha256"][i:i + 2] == rejoined["resumed_sha256"][j:j + 2]
    went_on = [r for r in run["steps"] if len(r["members"]) == 2]
    assert went_on and went_on[0]["step"] <= KILL and went_on[-1]["step"] >= HOLD  # job a trained alone
    assert went_on[0]["committed_at"] - run["killed"] < 30, "the survivor's next commit came late"
    assert all(len(r["members"]) == 4 for r in run["steps"] if r["step"] > rejoined["step"])


@pytest.mark.elastic
def test_torchrun_replicas_checkpoint_beside_the_records_each_written_by_the_quorum_of_its_step(run):
    lead = next(o for o in run["outs"] if (o / "summary.json").exists())
    assert not [p for o in run["outs"] if o != lead for p in o.glob("ckpt-*")]  # one directory a checkpoint
    members = {r["step"]: len(r["members"]) for r in run["steps"]}
    written = sorted(lead.glob("ckpt-*"))
    assert [int(p.name[5:]) for p in written] == list(range(EVERY, STEPS + 1, EVERY))
    for ckpt in written:  # every process of the quorum of the time wrote its file there, both jobs' alike
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert (manifest["world"], manifest["per_replica"]) == (members[manifest["step"]], 2), manifest
        assert sorted(manifest["files"]) == sorted([".metadata", "config.toml",
                                                    *(f"__{r}_0.distcp" for r in range(manifest["world"]))])


@pytest.mark.elastic
def test_the_launchers_replica_slots_restart_as_a_whole_and_match_the_plain_run(run):
    out = run["plain"].parent / "launched"
    assert "replica 1 (process 1) failed: killed by signal SIGKILL; the others go on; restarting it" in run["launched"]
    records = jsonl(out / "steps.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    plain = jsonl(run["plain"] / "steps.jsonl")
    assert [r["loss"] for r in records[:KILL - 1]] == [r["loss"] for r in plain[:KILL - 1]]  # both slots' steps
    hashes = json.loads((out / "summary.json").read_text())["elastic"]["final_params_sha256"]
    assert len(hashes) == 4 and len(set(hashes)) == 1, hashes
    rejoined = jsonl(out / "membership.jsonl")[-1]  # slot 1 back, both processes given the live state
    assert rejoined["committed"] == [KILL - 1] * 2 + [-1] * 2 and rejoined["healed"] == rejoined["slots"][2:]
    assert len(set(rejoined["state_sha256"])) == 1 and rejoined["replicas"][1].startswith("00001:")


def test_elastic_under_torchrun_needs_a_lighthouse_and_one_replica_a_job(capsys, tmp_path, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    for flags, line in ((["--elastic"], "--elastic under torchrun needs --lighthouse HOST:PORT"),
                        (["--elastic", "--lighthouse", "127.0.0.1:1", "--replicas", "2"], "drop --replicas"),
                        (["--elastic", "--lighthouse", "127.0.0.1:1", "--inside", "fsdp", "--strategy", "powersgd"],
                         "strategy 'powersgd' does not run with --inside fsdp inside a replica"),
                        (["--elastic", "--lighthouse", "127.0.0.1:1", "--max-restarts", "2"], "pass it to torchrun")):
        assert main(["train", *MODEL, *flags, "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and line in err, err
        assert not (tmp_path / "r").exists()



WATCH = """
import sys, time
import torch.distributed as dist
from lowcomm.elastic.replicas import MatesWatch
MatesWatch(dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False), 0, 3, 1.0, lambda: True)
time.sleep(30)
"""


@pytest.mark.elastic
def test_a_process_whose_mate_froze_kills_it_and_exits_so_torchrun_restarts_the_replica():
    import signal
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mates = {m: subprocess.Popen(["sleep", "30"]) for m in (1, 2)}  # process 1 finished, process 2 froze
    os.kill(mates[2].pid, signal.SIGSTOP)  # frozen: torchrun's SIGTERM would wait for a SIGCONT
    for m, mate in mates.items():
        store.set(f"pid/{m}", f"{socket.gethostname()}:{mate.pid}")
        store.add(f"beat/{m}", 1)  # each beat once, then went silent
    store.set("done/1", "1")  # process 1's silence is no failure: it finished the run
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(store.port)], stderr=subprocess.PIPE, text=True)
    try:
        assert watcher.wait(timeout=60) == 1
        assert mates[2].wait(timeout=10) == -signal.SIGKILL and mates[1].poll() is None
        err = watcher.stderr.read().strip()
        assert err.startswith("error: process 2 of this replica has been silent for ") and "\n" not in err, err
    finally:
        for p in (watcher, *mates.values()):
            p.kill()
            p.wait()


def _quorum(*members):
    """A lighthouse quorum as torchft's client returns it: (replica id, K, slot, held group, step)."""
    from types import SimpleNamespace as NS
    return NS(quorum_id=7, created=NS(seconds=1, nanos=2), participants=[
        NS(replica_id=i, world_size=k, address=json.dumps({"slot": slot, "held": held}), step=step,
           store_address=f"host-{i}:1") for i, k, slot, held, step in members])


def test_a_quorum_is_planned_alike_for_every_process_and_unequal_replicas_are_refused():
    from lowcomm.elastic.replicas import plan, view_of
    from lowcomm.errors import RunError
    first = plan(_quorum(("b", 2, -1, "", 0), ("a", 2, -1, "", 0)), None)
    assert first["ids"] == ["a", "b"] and first["slots"] == [0, 1] and first["store"] == "host-a:1"
    assert not first["same"]
    view = view_of(first, 1, "b")  # process 1 of replica b
    assert (view.rank, view.world, view.slots, view.shard()) == (3, 4, (0, 1, 2, 3), (1, 2, 1, 2))
    # the same replicas, each still on that group: go on; one lost it (rolled back): re-form
    assert plan(_quorum(("a", 2, 0, view.quorum, 5), ("b", 2, 1, view.quorum, 5)), view)["same"]
    assert not plan(_quorum(("a", 2, 0, view.quorum, 5), ("b", 2, 1, "", 5)), view)["same"]
    # a restarted replica is new: it takes the next free number, the survivor keeps its own
    again = plan(_quorum(("a", 2, 0, "", 5), ("c", 2, -1, "", -1)), view)
    assert again["slots"] == [0, 1] and again["steps"] == [5, -1] and not again["same"]
    with pytest.raises(RunError, match=r"^replicas of unequal size in one quorum \(2 and 4 processes\)"):
        plan(_quorum(("a", 2, 0, "", 5), ("c", 4, -1, "", -1)), view)

"""What a run does when something goes wrong, seen from outside as a user sees it.

- a worker killed with SIGKILL: the launcher stops the other within 10 s, exits 1 with
  one `error:` line naming the rank and the signal, and leaves no worker process behind;
- a rank alive but stuck before a collective: the run fails within --timeout;
- SIGINT / SIGTERM to the launcher process alone (a subprocess, as a user or a batch
  scheduler sends it): every worker gone within 10 s, exit 130 / 143; with
  --checkpoint-on-signal a checkpoint is written first and the run resumes from it;
- two runs started in the same second keep separate default directories; --overwrite
  leaves no file of the old run.
Bad input is in tests/cli/test_cli_errors.py; trace nesting for every strategy in tests/test_contract.py.
Faults are injected through the worker's test-only LOWCOMM_TEST_* variables.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import lowcomm.launch.launcher
from lowcomm.launch import rundir
from lowcomm.cli.main import main
from tiny_runs import TINY, children, error_line, running, workers_of

# How soon the launcher stops after a worker dies or it is signalled: a few seconds on a quiet
# machine. The claim is that it does not wait for anything (a launcher that did not notice would
# wait out --timeout, 600 s by default), so the bound is a tenth of that, not a quiet machine's time.
STOP_WITHIN_S = 60.0


class WatchWorkers:
    """Notes every worker process of this (the launcher's) process while the block runs."""

    def __enter__(self):
        self.seen: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._done.wait(0.05):
            self.seen |= workers_of(os.getpid())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def wait_for_steps(out: Path, n: int, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "steps.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps in {out} within {timeout} s")


@pytest.mark.faults
def test_a_killed_worker_fails_the_run_without_waiting_for_the_timeout(tmp_path, data_file, monkeypatch, capfd):
    killed_at = tmp_path / "killed"
    monkeypatch.setenv("LOWCOMM_TEST_KILL_AT", "1:2")  # rank 1 SIGKILLs itself after step 2
    monkeypatch.setenv("LOWCOMM_TEST_KILL_LOG", str(killed_at))
    out = tmp_path / "run"
    with WatchWorkers() as workers:
        code = main(["train", *TINY, "--steps", "100000", "--data", str(data_file), "--out", str(out)])
        returned = time.time()
    assert code == 1
    took = returned - float(killed_at.read_text())
    assert took < STOP_WITHIN_S, f"the launcher returned {took:.1f} s after the kill"
    assert len(workers.seen) == 2 and not [p for p in workers.seen if running(p)]
    line = error_line(capfd.readouterr().err)
    assert "rank 1" in line and "SIGKILL" in line, line


@pytest.mark.faults
def test_a_stuck_peer_fails_the_run_within_the_timeout(tmp_path, data_file, monkeypatch, capfd):
    monkeypatch.setenv("LOWCOMM_TEST_HANG_AT", "1:3")  # rank 1 blocks forever before step 3
    out = tmp_path / "run"
    with WatchWorkers() as workers:
        code = main(["train", *TINY, "--steps", "100000", "--timeout", "2", "--data", str(data_file),
                     "--out", str(out)])
        returned = time.time()
    assert code == 1
    # steps.jsonl was last written at step 2, just before rank 1 stopped responding
    # the 2 s timeout, then tear-down: well before --timeout's default 600 s would have fired
    assert returned - (out / "steps.jsonl").stat().st_mtime < 2 + STOP_WITHIN_S
    assert not [p for p in workers.seen if running(p)]
    line = error_line(capfd.readouterr().err)
    assert "timed out after 2 s" in line and "--timeout" in line and "error.log" in line, line
    assert "Traceback" in (out / "error.log").read_text()


@pytest.mark.faults
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_alone_stops_every_worker(sig, tmp_path, data_file):
    out = tmp_path / "run"
    # What a preempted batch job uses; a constant lr (no warmup: its length is capped by --steps),
    # so that a run of another length is the reference.
    extra = ["--checkpoint-on-signal", "--schedule", "constant", "--warmup", "0"] if sig == signal.SIGTERM else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", "train", *TINY, "--steps", "100000", "--data", str(data_file),
         "--out", str(out), *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)  # its own session: the signal reaches the launcher alone
    workers: set[int] = set()
    try:
        wait_for_steps(out, 1, proc)  # training, not starting up
        workers = workers_of(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, sig)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
        assert took < STOP_WITHIN_S, f"the launcher took {took:.1f} s to stop; {err}"
        assert not [p for p in workers if running(p)]
    finally:
        for pid in [proc.pid, *workers]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 128 + sig
    line = error_line(err)
    assert f"interrupted by {sig.name}" in line, line
    if not extra:
        return
    # The checkpoint was taken at a step all ranks agreed on, after that step's record; the
    # run continues from it with every step logged once, exactly as a run never stopped.
    assert "wrote a checkpoint" in line, line
    last = len((out / "steps.jsonl").read_text().splitlines())
    assert sorted(p.name for p in out.glob("ckpt-*"))[-1] == f"ckpt-{last:06d}"
    assert main(["train", "--resume", str(out), "--steps", str(last + 2), "--quiet"]) == 0
    straight = tmp_path / "straight"
    assert main(["train", *TINY, *extra[1:], "--steps", str(last + 2), "--data", str(data_file),
                 "--out", str(straight)]) == 0
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (run / "steps.jsonl").read_text().splitlines())]
              for run in (out, straight)]
    assert losses[0] == losses[1] and len(losses[0]) == last + 2


def test_runs_started_in_the_same_second_keep_their_results(tmp_path, data_file, monkeypatch, capsys):
    """The default directory has the time in seconds in its name; the second run of that
    second gets its own (the launch is replaced: what is tested is where results go)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt, *a: "20260101-120000")

    def fake_launch(cfg, out, quiet=False):
        (out / "steps.jsonl").write_text(json.dumps({"seed": cfg.seed}) + "\n")
    monkeypatch.setattr(lowcomm.launch.launcher, "launch", fake_launch)
    for seed in (1, 2):
        assert main(["train", "--seed", str(seed), "--data", str(data_file), "--quiet"]) == 0
    first, second = tmp_path / "runs" / "ddp-w2-20260101-120000", tmp_path / "runs" / "ddp-w2-20260101-120000-2"
    assert sorted((tmp_path / "runs").iterdir()) == [first, second]
    for seed, run in ((1, first), (2, second)):
        assert json.loads((run / "steps.jsonl").read_text()) == {"seed": seed}
        assert f"seed = {seed}" in (run / "config.toml").read_text()
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"lowcomm: results in {Path('runs') / first.name}",
                       f"lowcomm: results in {Path('runs') / second.name}"]


def test_claiming_a_default_directory_is_atomic(tmp_path):
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: rundir.create(tmp_path / "runs" / "x", False, default=True), range(8)))
    assert len(set(got)) == 8 and all(p.is_dir() for p in got)


def test_overwrite_leaves_no_file_of_the_old_run(tmp_path, data_file, monkeypatch):
    out = tmp_path / "run"
    (out / "ckpt-000004").mkdir(parents=True)
    (out / "ckpt-000004" / "__0_0.distcp").write_bytes(b"old")
    (out / "config.toml").write_text('strategy = "zero1"\nsteps = 4\n')
    for name in ("steps.jsonl", "summary.json", "trace.json", "error.log", "notes-of-the-run.txt"):
        (out / name).write_text("old\n")
    monkeypatch.setattr(lowcomm.launch.launcher, "launch", lambda cfg, out, quiet=False: None)
    assert main(["train", "--data", str(data_file), "--out", str(out), "--overwrite", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.toml"]
    assert 'strategy = "ddp"' in (out / "config.toml").read_text()


@pytest.mark.faults
def test_a_sigkilled_launcher_takes_its_workers_and_fork_server_with_it(tmp_path, data_file):
    """A scheduler's `kill -9` or the OOM killer taking the launcher: every worker and the
    fork server they were forked from are gone within seconds, and the run writes no summary."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowcomm", "train", *TINY, "--steps", "100000", "--data", str(data_file),
         "--out", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    left: set[int] = set()
    try:
        wait_for_steps(out, 2, proc)
        left = workers_of(proc.pid) | children(proc.pid)  # the workers, the fork server, its helpers
        assert len(workers_of(proc.pid)) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + STOP_WITHIN_S  # a hang guard: they go on their own or never
        while time.monotonic() < deadline and [p for p in left if running(p)]:
            time.sleep(0.05)
        assert not [p for p in left if running(p)], "processes of the killed launcher are still running"
        time.sleep(0.5)
        assert not (out / "summary.json").exists()
    finally:
        for pid in [proc.pid, *left]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()

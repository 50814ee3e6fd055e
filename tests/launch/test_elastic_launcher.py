"""The elastic launcher's watch over its worker slots (launch/elastic.py), in the test's process
with fake workers: each death reaches the handler, however the deaths interleave with the wait.

Two workers killed together: the wait wakes for the first, the second dies before the next look,
and reading a process's exit status reaps it. The interleaving is forced by a fake wait, not timed.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import signal

import pytest
from fake_lighthouse import status_page

from lowcomm import config as C
from lowcomm.errors import RunError
from lowcomm.launch import elastic, supervise


class FakeProcess:
    """A worker process whose death the test decides: `die(code)` sets its exit status and makes
    its sentinel readable, as a real process's is once it has exited."""

    def __init__(self):
        self._read, self._write = os.pipe()
        self.sentinel, self.code = self._read, None

    @property
    def exitcode(self):
        return self.code

    def die(self, code: int, wake: bool = True) -> None:
        self.code = code
        if wake and self._write is not None:
            os.close(self._write)
            self._write = None

    def close(self) -> None:
        for fd in (self._read, self._write):
            if fd is not None:
                os.close(fd)


class FakeContext:
    def __init__(self):
        self.processes, self.error_files = [FakeProcess()], ["/nonexistent/lowcomm-test-error-file"]


@pytest.fixture
def launched(monkeypatch):
    """Slots that start fake workers; `started` lists (slot, joining, context) as they start."""
    started: list[tuple[int, bool, FakeContext]] = []

    def start(self, slot: int, joining: bool) -> None:
        ctx = FakeContext()
        started.append((slot, joining, ctx))
        self.live[slot] = ctx
        self.attempts[slot] += 1

    monkeypatch.setattr(elastic.Slots, "start", start)
    monkeypatch.setattr(supervise, "stop", lambda processes, grace=0: None)
    yield started
    for _, _, ctx in started:
        ctx.processes[0].close()


def watch(cfg, started, monkeypatch, at_each_wait, lighthouse: str = "http://127.0.0.1:1") -> None:
    """Run the launcher's watch; `at_each_wait(n)` acts at its n-th wait (n from 0), before the
    wait looks, and returns what the wait reports as woken up (None: what a real wait would)."""
    real_wait, waits = multiprocessing.connection.wait, [0]

    def wait(objects, timeout=None):
        n = waits[0]
        waits[0] += 1
        assert n < 200, "the launcher kept waiting: a death never reached it (it would hang for ever)"
        woken = at_each_wait(n)
        return real_wait(objects, timeout=0.01) if woken is None else woken

    monkeypatch.setattr(multiprocessing.connection, "wait", wait)
    elastic.Slots(cfg, 0, lighthouse, None, quiet=True).run()


def two_die_together(started):
    """At the first wait, worker 0 dies (its sentinel wakes the wait) and worker 1 dies just after
    the wait returned: its sentinel was in the wait's list, but the wait reported only worker 0."""
    def at_wait(n):
        if n == 0:
            first, second = started[0][2].processes[0], started[1][2].processes[0]
            first.die(-signal.SIGKILL)
            second.die(-signal.SIGKILL, wake=False)
            return [first.sentinel]
        return None
    return at_wait


def test_two_workers_killed_together_are_both_restarted(launched, monkeypatch, capfd):
    cfg = C.RunConfig(workers=3, elastic=True, min_workers=2, max_restarts=2)
    two_at_once = two_die_together(launched)

    def at_wait(n):
        woken = two_at_once(n)
        if n == 5:  # the run goes on, then every live worker finishes
            for _, _, ctx in launched:
                if ctx.processes[0].exitcode is None:
                    ctx.processes[0].die(0)
        return woken

    watch(cfg, launched, monkeypatch, at_wait)
    assert [(slot, joining) for slot, joining, _ in launched] == [(0, False), (1, False), (2, False),
                                                                  (0, True), (1, True)]
    err = capfd.readouterr().err
    assert "worker 0 failed: killed by signal SIGKILL" in err and "restarting it (1 of 2)" in err
    assert "worker 1 failed: killed by signal SIGKILL" in err and "restarting it (2 of 2)" in err


@pytest.fixture
def lighthouse_page():
    """A lighthouse that answers."""
    with status_page("New quorum not ready, only have 1 participants, need min_replicas 2") as url:
        yield url


def test_two_workers_killed_together_with_no_restart_left_fail_the_run_below_min_workers(
        launched, monkeypatch, lighthouse_page):
    cfg = C.RunConfig(workers=3, elastic=True, min_workers=2, max_restarts=0)
    with pytest.raises(RunError) as e:
        watch(cfg, launched, monkeypatch, two_die_together(launched), lighthouse_page)
    assert str(e.value).startswith("1 live worker(s), fewer than --min-workers 2, and no restart left: worker ")


def test_a_run_failing_below_min_workers_with_its_lighthouse_lost_says_so_first(launched, monkeypatch):
    cfg = C.RunConfig(workers=2, elastic=True, min_workers=2, max_restarts=0)

    def at_wait(n):
        if n == 0:  # worker 1 fails as workers do when the lighthouse is gone (membership.py)
            died = launched[1][2].processes[0]
            died.die(1)
            return [died.sentinel]
        return None
    with pytest.raises(RunError) as e:  # nothing answers at the lighthouse's address
        watch(cfg, launched, monkeypatch, at_wait, lighthouse="http://127.0.0.1:1")
    line = str(e.value)
    assert line.startswith("the lighthouse at http://127.0.0.1:1 is lost: 1 live worker(s), fewer than "
                           "--min-workers 2"), line
    assert "worker 1 failed: exited with code 1; it does not answer now: " in line


def test_a_torchrun_job_that_did_not_lead_the_run_says_where_its_records_are(tmp_path):
    import socket
    from lowcomm.launch.launcher import results_line
    mine, lead = tmp_path / "tb2", tmp_path / "tb1"
    here = socket.gethostname()
    assert results_line(mine, None) == f"lowcomm: results in {mine}"  # a plain or a launcher's run
    assert results_line(mine, f"{here}:{mine.resolve() / 'steps.jsonl'}") == f"lowcomm: results in {mine}"
    assert results_line(mine, f"{here}:{lead / 'steps.jsonl'}") == (
        f"lowcomm: the run's records are in {lead} on {here} (the --out of the job that led it at its end); "
        f"this job's {mine} holds its config.toml")
    assert f"are in {mine.resolve()} on other-host " in results_line(mine, f"other-host:{mine.resolve() / 'steps.jsonl'}")


def test_a_worker_left_behind_when_the_run_finishes_is_stopped_and_said(launched, monkeypatch, capfd):
    """Worker 1 was dropped (frozen past --member-timeout) and continued after the others' last
    step: the run finishes without it, and the launcher says it stops it."""
    monkeypatch.setattr(elastic, "FINISH_GRACE_S", 0.0)
    cfg = C.RunConfig(workers=3, elastic=True, min_workers=2)

    def at_wait(n):
        if n == 0:  # workers 0 and 2 finish the run; worker 1 is still running
            for slot in (0, 2):
                launched[slot][2].processes[0].die(0)
            return [launched[0][2].processes[0].sentinel]
        return None
    watch(cfg, launched, monkeypatch, at_wait)
    assert capfd.readouterr().err.strip().splitlines() == [
        "lowcomm: worker 1 had not finished 0 s after the run did (no longer a member: dropped from the run, or "
        "still waiting to join it); stopped it"]


def test_a_failed_elastic_run_writes_every_slots_flight_ring_and_points_to_them(tmp_path):
    from lowcomm.comm.flight import CODE, FlightRecorder, ring_name
    rings, out = tmp_path / "rings", tmp_path / "run"
    rings.mkdir()
    out.mkdir()
    for slot in (0, 1):
        FlightRecorder(slot, path=rings / ring_name(slot)).open(CODE["all_reduce"], t0=100.0, seq=1)  # open
    error = RunError("worker 0 had no quorum for 5 s (--quorum-timeout 5)")
    elastic.record_flight(error, str(rings), C.RunConfig(workers=2, elastic=True), out)
    assert sorted(p.name for p in (out / "flight").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert str(error) == f"worker 0 had no quorum for 5 s (--quorum-timeout 5) (flight records in {out / 'flight'})"

"""A member's waits on the run's services (elastic/membership.py), in the test's process with a
fake lighthouse client and a fake store: a lighthouse stalled at a worker's first heartbeat is
waited for, and one lost for good fails the worker in one line naming it; a quorum long in
coming is said every minute, with the lighthouse's own figures, and ends the run past
--quorum-timeout (a clock the test moves); a commit never waits on the launcher's store, and a
re-form that does (a stopped launcher) is said.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from fake_lighthouse import status_page

from lowcomm.elastic import lighthouse, membership
from lowcomm.elastic.address import check_lighthouse, lighthouse_status, min_replicas
from lowcomm import config as C
from lowcomm.errors import NoQuorum, RunError, UsageError

HANG_GUARD_S = 60.0  # not a timing claim: how long a call that must not block may take before the test fails
STALLED = TimeoutError('status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { headers: {} }')
STATUS = ("New quorum not ready, only have 3 participants, need min_replicas 5 [3/3 participants healthy]"
          "[3 heartbeating][shrink_only=false]")


class FakeClient:
    """torchft's LighthouseClient as a stalled lighthouse answers it: each call raises `fails`'s
    next error while there is one."""

    def __init__(self, fails: list):
        self.fails, self.beats = fails, 0
        self.answer = lambda: "a quorum"  # what a quorum request returns once nothing fails

    def heartbeat(self, replica_id, timeout=None):
        if self.fails:
            raise self.fails.pop(0)
        self.beats += 1

    def quorum(self, **kwargs):
        if self.fails:
            raise self.fails.pop(0)
        return self.answer()


class FakeStore:
    """The launcher's TCP store; `stopped` set, a call blocks as a SIGSTOPped launcher's does
    (`entered` says one does); `fails`: the error each call raises (the store's timeout)."""

    def __init__(self, *args, **kwargs):
        self.counts, self.stopped, self.resumed, self.entered = {}, threading.Event(), threading.Event(), threading.Event()
        self.fails = None

    def add(self, key, n):
        if self.fails is not None or self.stopped.is_set():
            self.entered.set()
        if self.fails is not None:
            raise self.fails
        if self.stopped.is_set():
            self.resumed.wait()
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


class NoBeatsProcess:
    """The heartbeats' own process (lighthouse.BeatsProcess), not started: a fake lighthouse
    answers in this process only."""

    def __init__(self, address, replica_id):
        pass

    def keep(self):
        pass

    def stop(self):
        pass

    def close(self):
        pass


@pytest.fixture
def member(monkeypatch):
    """member(fails) -> a Membership on a fake lighthouse whose calls raise `fails` first."""
    made = []

    def make(fails: list, address: str = "http://127.0.0.1:1", slot: int = 0, speaks: bool = True):
        stores = []
        monkeypatch.setattr(membership.dist, "TCPStore", lambda *a, **k: stores.append(FakeStore()) or stores[-1])
        monkeypatch.setattr(lighthouse, "client", lambda address: FakeClient(fails))
        monkeypatch.setattr(lighthouse, "BeatsProcess", NoBeatsProcess)  # no lighthouse to beat to
        m = membership.Membership(address, "127.0.0.1", 1, slot=slot, timeout_s=5.0, speaks=speaks)
        m.stores = stores
        made.append(m)
        return m
    yield make
    for m in made:
        m.close()


@pytest.fixture
def lighthouse_page():
    """A lighthouse's dashboard saying what its next quorum waits for."""
    with status_page(STATUS) as url:
        yield url


def test_a_worker_started_while_the_lighthouse_is_stalled_waits_for_it(member):
    m = member([STALLED, STALLED, STALLED])  # three beats time out, then the lighthouse answers
    assert m._beats.beats == 1  # the first heartbeat, once it answered: no restart used up


def test_a_lighthouse_lost_for_good_fails_the_first_heartbeat_in_one_line_naming_it(member, monkeypatch):
    monkeypatch.setattr(membership, "LIGHTHOUSE_AWAY_S", 0.0)
    with pytest.raises(RunError) as e:
        member([STALLED] * 1000)
    line = str(e.value)
    assert line.startswith("the lighthouse at http://127.0.0.1:1 did not answer its first heartbeat for 0 s")
    assert "\n" not in line


def test_another_error_of_the_first_heartbeat_is_not_taken_for_a_lighthouse_away(member):
    with pytest.raises(ValueError):
        member([ValueError("bad replica id")])


def test_a_quorum_long_in_coming_is_said_every_minute_and_ends_the_run_past_the_quorum_timeout(
        member, lighthouse_page, capsys):
    m = member([], address=lighthouse_page)
    m.quorum_timeout_s = 150.0
    now = [0.0]
    waiting = membership.Waiting(m, clock=lambda: now[0])  # a member holding the run's state
    for now[0] in (1.0, 59.0, 60.0, 61.0, 119.0, 121.0, 150.0):
        waiting.check()
    lines = capsys.readouterr().err.strip().splitlines()
    said = f"for a quorum; the lighthouse at {lighthouse_page} says: {STATUS}; the run fails after 150 s without one"
    assert lines == [f"lowcomm: worker 0 has waited 60 s {said} (--quorum-timeout)",
                     f"lowcomm: worker 0 has waited 121 s {said} (--quorum-timeout)"]
    now[0] = 151.0
    with pytest.raises(NoQuorum) as e:
        waiting.check()
    assert str(e.value) == (f"worker 0 had no quorum for 151 s (--quorum-timeout 150); the lighthouse at "
                            f"{lighthouse_page} says: {STATUS}")


def test_a_joiner_waiting_for_the_members_next_commit_point_is_not_ended_by_the_quorum_timeout(
        member, lighthouse_page, capsys):
    m = member([], address=lighthouse_page)
    m.quorum_timeout_s = 150.0
    now = [0.0]
    waiting = membership.Waiting(m, bounded=False, clock=lambda: now[0])  # a fresh process: no state of the run
    now[0] = 3600.0
    waiting.check()
    assert capsys.readouterr().err.strip() == (f"lowcomm: worker 0 has waited 3600 s for a quorum; the lighthouse "
                                               f"at {lighthouse_page} says: {STATUS}")


def test_a_member_whose_quorum_requests_time_out_past_the_quorum_timeout_fails_the_run(member, monkeypatch):
    m = member([])
    m.quorum_timeout_s = 0.0
    monkeypatch.setattr(membership, "QUORUM_QUIET_S", 1e9)  # no line: the page at 127.0.0.1:1 answers nothing
    m._client.fails = [TimeoutError("Timeout expired")] * 1000
    with pytest.raises(NoQuorum, match=r"^worker 0 had no quorum for \d+ s \(--quorum-timeout 0\)"):
        m._quorum(step=4)


def test_a_commit_reads_the_joiners_count_without_waiting_on_the_launchers_store(member):
    m = member([])
    store, reader = m.stores  # the member's store, and its joiners' count reader's
    store.counts = reader.counts  # one store, two clients
    store.add(membership.JOINS, 1)  # a joiner announced itself
    wait_for(lambda: m.joins() == 1, "the first count")
    reader.stopped.set()  # the launcher is stopped (SIGSTOP): a call to its store blocks
    counted = []
    commit = threading.Thread(target=lambda: counted.append(m.joins()), daemon=True)
    commit.start()
    commit.join(HANG_GUARD_S)
    assert counted == [1]  # at once: the commit did not wait on the stopped launcher
    reader.counts[membership.JOINS] = 2  # a joiner announced itself; the launcher continues
    reader.resumed.set()
    wait_for(lambda: m.joins() >= 2, "the joiner's announcement")


def wait_for(ready, what: str) -> None:
    done = threading.Event()
    for _ in range(int(HANG_GUARD_S / 0.05)):
        if ready():
            return
        done.wait(0.05)
    pytest.fail(f"no {what} within {HANG_GUARD_S:.0f} s")


def test_the_lighthouse_status_line_and_its_min_replicas_are_read_from_its_page(lighthouse_page):
    assert lighthouse_status(lighthouse_page) == STATUS
    assert min_replicas(STATUS) == 5


def test_a_lighthouse_that_would_wait_for_more_members_than_the_run_has_is_refused(lighthouse_page):
    with pytest.raises(UsageError, match="waits for 5 members .* and this run has 4: it would wait for ever"):
        check_lighthouse(lighthouse_page, "--lighthouse x", members=4)
    check_lighthouse(lighthouse_page, "--lighthouse x", members=5)


def quorum_of(*members: tuple[str, int]):
    """A torchft quorum of these (replica id, committed step) members."""
    return SimpleNamespace(quorum_id=7, created=SimpleNamespace(seconds=1, nanos=0),
                           participants=[SimpleNamespace(replica_id=i, step=step) for i, step in members])


def test_a_survivors_announcement_held_up_by_a_stopped_launcher_is_said_by_the_new_quorums_rank_0(
        member, monkeypatch, capsys):
    """After a peer is lost the survivors announce themselves on the launcher's store; with the
    launcher stopped that announcement blocks, and the member says so past STORE_QUIET_S, though
    it is not slot 0 (the slot lost may be 0): the new quorum's rank 0 speaks."""
    monkeypatch.setattr(membership, "STORE_QUIET_S", 0.0)
    monkeypatch.setattr(membership, "form_group", lambda view, store, timeout_s: None)
    m = member([], slot=2, speaks=False)
    store = m.stores[0]
    store.stopped.set()  # the launcher is stopped (SIGSTOP)
    # the lighthouse answers once the announcement is blocked on the store
    m._client.answer = lambda: store.entered.wait(HANG_GUARD_S) and quorum_of((m.id, 3))
    views = []
    agreeing = threading.Thread(target=lambda: views.append(m.agree(3, joining=True)), daemon=True)
    agreeing.start()
    err = []
    wait_for(lambda: err.append(capsys.readouterr().err) or "has waited" in "".join(err), "the line")
    assert "".join(err).startswith("lowcomm: worker 2 has waited 0 s to form the new quorum's group on the "
                                   "launcher's store at 127.0.0.1:1")
    store.resumed.set()  # the launcher continues
    agreeing.join(HANG_GUARD_S)
    assert [(v.rank, v.slots) for v in views] == [(0, (2,))]
    assert m.latest == views[0]


def test_a_new_group_formed_in_time_says_nothing(member, monkeypatch, capsys):
    monkeypatch.setattr(membership, "form_group", lambda view, store, timeout_s: None)
    m = member([])
    m._client.answer = lambda: quorum_of((m.id, 0))
    m.agree(0)
    assert capsys.readouterr().err == ""


def test_an_announcement_the_launchers_store_never_takes_fails_the_worker_in_one_line(member, monkeypatch):
    monkeypatch.setattr(membership, "form_group", lambda view, store, timeout_s: None)
    m = member([])
    store = m.stores[0]
    store.fails = RuntimeError("Socket Timeout\n  (store's trace)")
    m._client.answer = lambda: store.entered.wait(HANG_GUARD_S) and quorum_of((m.id, 3))  # once it announced
    with pytest.raises(RunError) as e:
        m.agree(3, joining=True)
    assert str(e.value) == ("the launcher's store at 127.0.0.1:1 did not take this worker's announcement: "
                            "Socket Timeout (store's trace)")


# -- a member's re-forms (train/elastic.py's run_elastic), on a fake worker --------------------------

class FakeWorker:
    """An ElasticWorker whose memberships end as `script` says, one entry each: "commit" (it
    commits a step, then a peer is lost), "fail" (a peer is lost before it commits), "fresh" (its
    quorum holds no one with the run's state), "done" (the run ends)."""

    def __init__(self, script: list[str]):
        self.script, self.step, self.snapshot, self.finished = list(script), 0, {"step": 0}, False
        self.cfg, self.t, self.outputs = C.RunConfig(elastic=True, out="runs/el"), None, None
        self.progress = type("P", (), {"forget_after": lambda self, step: None, "t_start": 0.0})()

    def form(self, joining):
        from lowcomm.train import elastic as E
        self.now = self.script.pop(0)
        if self.now == "fresh":
            raise E.NoStateHere("a quorum of 2 member(s) formed at the lighthouse, none of them holding the run's state")

    def train(self):
        if self.now == "commit":
            self.step += 1
            self.snapshot = {"step": self.step}
        if self.now != "done":
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        return type("R", (), {"stopped": False})()

    def rollback(self):
        self.step = self.snapshot["step"]

    def finish(self, result):
        self.finished = True


@pytest.fixture
def elastic_life(monkeypatch):
    """elastic_life(script) -> run_elastic's worker, or the error it ended with."""
    from lowcomm.train import elastic as E
    monkeypatch.setattr(E, "NO_STATE_WAIT_S", 0.0)
    monkeypatch.setattr(E, "loop", lambda t, outputs, w, progress: w.train())

    def live(script):
        worker = FakeWorker(script)
        monkeypatch.setattr(E, "ElasticWorker", lambda *a, **k: worker)
        monkeypatch.setattr(E.torch, "set_num_threads", lambda n: None)
        return E.run_elastic(worker.cfg, 0, None, None, True, joining=True)
    return live


def test_a_long_runs_faults_each_after_progress_never_add_up_to_giving_up(elastic_life):
    worker = elastic_life(["commit"] * 50 + ["done"])  # 50 faults, each after a committed step
    assert worker.finished and worker.step == 50


def test_memberships_that_commit_nothing_give_up_in_one_line_naming_the_last_error(elastic_life):
    from lowcomm.train import elastic as E
    with pytest.raises(RunError) as e:
        elastic_life(["commit"] + ["fail"] * (E.MAX_REFORMS_WITHOUT_PROGRESS + 1))
    assert str(e.value).startswith(f"the group changed {E.MAX_REFORMS_WITHOUT_PROGRESS + 1} times without "
                                   f"committing a step (the last: [../third_party/gloo")
    assert "Connection closed by peer); giving up" in str(e.value)


def test_a_quorum_of_fresh_members_waits_for_the_state_and_never_starts_the_run_over(elastic_life):
    from lowcomm.errors import StateLost
    from lowcomm.train import elastic as E
    assert elastic_life(["fresh"] * 3 + ["done"]).finished  # the members with the state came back
    with pytest.raises(StateLost) as e:  # they never do: the run ends, pointing at its checkpoints
        elastic_life(["fresh"] * (E.MAX_REFORMS_WITHOUT_PROGRESS + 1))
    assert "every worker that held the run's state is gone" in str(e.value)
    assert str(e.value).endswith("lowcomm train --resume runs/el")


@pytest.mark.parametrize("error, ends_the_run", [("lowcomm.errors.StateLost", True), ("lowcomm.errors.BadSteps", True),
                                                 ("lowcomm.errors.RunError", False), ("RuntimeError", False)])
def test_the_launcher_ends_the_run_for_the_runs_failures_and_restarts_a_worker_for_its_own(error, ends_the_run):
    from lowcomm.launch import supervise
    tb = f'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n{error}: what happened\n'
    assert supervise.failed_the_run(tb) is ends_the_run
    assert supervise._last_line(tb) == ("what happened" if error.startswith("lowcomm") else f"{error}: what happened")


def test_a_joiner_waiting_to_rejoin_when_the_run_ends_stops_in_one_line_not_while_a_member(tmp_path, monkeypatch,
                                                                                              capsys):
    """`lowcomm join`'s worker, dropped (frozen, then continued) after it had joined, waits to
    rejoin: the run's end (summary.json) ends it at once, in one line, not after the 60 s of a
    lighthouse gone; while it is a member of a quorum, the run's end is its own to finish."""
    from lowcomm.launch import join
    member = SimpleNamespace(waiting=False, joined=threading.Event())
    member.joined.set()
    looks = []

    def look(seconds):  # the watch's pause between looks; the worker is dropped at the third
        looks.append(seconds)
        member.waiting = len(looks) >= 3

    def exit_now(code):
        raise SystemExit(code)
    monkeypatch.setattr(join.time, "sleep", look)
    monkeypatch.setattr(join.os, "_exit", exit_now)
    (tmp_path / "summary.json").write_text("{}")  # the run has ended
    with pytest.raises(SystemExit) as e:
        join.watch(tmp_path, member)
    assert e.value.code == 1 and len(looks) == 3  # not while it was a member
    assert capsys.readouterr().err == f"error: the run in '{tmp_path}' ended before this worker could rejoin it\n"

"""Test-only fault injection, kept out of the training loop: `inject(run, rank)` returns the
run unchanged unless a LOWCOMM_TEST_* variable asks for a fault, and then a stand-in whose
step() misbehaves at the asked step (the tests of supervision and recovery use it); `watched(member)`
does the same for an elastic member's membership policy (its commit points and its re-forms):

    LOWCOMM_TEST_HANG_AT=RANK:STEP    that rank blocks forever before that step (alive but stuck)
    LOWCOMM_TEST_STOP_AT=RANK:STEP    that rank SIGSTOPs itself before that step (frozen, as by a debugger
                                      or a scheduler: not even its threads run), once a process (continued,
                                      an elastic worker that redoes the step is not stopped again)
    LOWCOMM_TEST_NAN_AT=RANK:STEP     that rank's loss is NaN in that step
    LOWCOMM_TEST_KILL_AT=RANK:STEP    that rank is SIGKILLed after that step; the i-th entry fires in
                                      launch attempt i (LOWCOMM_ATTEMPT, or torchrun's restart count)
    LOWCOMM_TEST_KILL_IN=RANK:STEP[:FILE]  that rank is SIGKILLed inside a collective: the first one of
                                      the strategy's own traffic from that step on (and, with FILE, once
                                      FILE exists), once it is issued (its peers wait in it for this
                                      rank's part); by launch attempt as KILL_AT
    LOWCOMM_TEST_HOLD_FOR_JOINER, LOWCOMM_TEST_COMMIT_HASHES  (--elastic) see their functions below
    LOWCOMM_TEST_KILL_BEFORE_LOG=RANK:STEP  (--elastic) that rank of the quorum is SIGKILLed at that
                                      step's commit point once every member has committed the step,
                                      before it writes the step's records (as rank 0, the log's writer);
                                      by launch attempt as KILL_AT
Each takes a comma-separated list of RANK:STEP.
"""
from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..elastic.membership import Membership


def inject(run, rank: int):
    """`run`, or a stand-in for it that injects the faults the environment asks for."""
    if not any(os.environ.get(f"LOWCOMM_TEST_{name}") for name in ("HANG_AT", "STOP_AT", "NAN_AT", "KILL_AT",
                                                                   "KILL_IN")):
        return run
    return _FaultyRun(run, rank)


class _FaultyRun:
    """The run with faults around step(); everything else is the run's own."""

    def __init__(self, run, rank: int):
        self._run, self._rank = run, rank

    def __getattr__(self, name):
        return getattr(self._run, name)

    def step(self, next_batch, loss_fn):
        step = self._run.steps_done + 1
        hang_if_asked(self._rank, step)
        stop_if_asked(self._rank, step)
        kill_inside_collective_if_asked(getattr(self._run, "comm", None), self._rank, step)
        result = self._run.step(next_batch, nan_loss_if_asked(self._rank, step, loss_fn))
        kill_if_asked(self._rank, step)
        return result


def watched(member):
    """An elastic member (train/elastic.py's ElasticWorker, the loop's membership policy), or a
    stand-in for it that injects the --elastic faults the environment asks for."""
    if not any(os.environ.get(f"LOWCOMM_TEST_{name}") for name in ("HOLD_FOR_JOINER", "COMMIT_HASHES",
                                                                   "KILL_BEFORE_LOG")):
        return member
    return _FaultyMember(member)


class _FaultyMember:
    """The member with faults at its commit points; everything else is the member's own."""

    def __init__(self, member):
        self._member = member

    def __getattr__(self, name):
        return getattr(self._member, name)

    def committed(self, t, records: list[dict]) -> None:
        w = self._member
        w.committed(t, records)
        note_commit_if_asked(w.slot, w.step, lambda: w.hash_of(w.snapshot))
        kill_if_asked(w.view.rank, w.step, "KILL_BEFORE_LOG")

    def leaves(self, step: int, joins: int) -> bool:
        w = self._member
        return w.leaves(step, max(joins, hold_for_joiner_if_asked(step, w.m, w.joins_seen, w.since)))


def hang_if_asked(rank: int, step: int) -> None:
    """Test-only fault: LOWCOMM_TEST_HANG_AT=RANK:STEP makes that rank block forever
    before that step's collectives (alive but stuck), as a hung peer would."""
    if (rank, step) in _fault_spec("HANG_AT"):
        while True:
            time.sleep(3600)


_stopped: set[tuple[int, int]] = set()


def stop_if_asked(rank: int, step: int) -> None:
    """Test-only fault: LOWCOMM_TEST_STOP_AT=RANK:STEP SIGSTOPs that rank before that step, once;
    LOWCOMM_TEST_STOP_LOG gets "TIME PID" first, for a test to time it and continue it (SIGCONT)."""
    if (rank, step) in _fault_spec("STOP_AT") and (rank, step) not in _stopped:
        _stopped.add((rank, step))
        _note("STOP_LOG", f"{time.time()} {os.getpid()}")
        os.kill(os.getpid(), signal.SIGSTOP)


def _note(name: str, line: str) -> None:
    """Append a line to the file LOWCOMM_TEST_<name> names, if set (when a fault fired)."""
    if os.environ.get(f"LOWCOMM_TEST_{name}"):
        with open(os.environ[f"LOWCOMM_TEST_{name}"], "a") as f:
            f.write(line + "\n")


def _fault_spec(name: str) -> list[tuple[int, int]]:
    """LOWCOMM_TEST_<name>=RANK:STEP[,RANK:STEP...] (test-only fault injection)."""
    spec = os.environ.get(f"LOWCOMM_TEST_{name}", "")
    return [tuple(int(x) for x in part.split(":")) for part in spec.split(",") if part.strip()]


def kill_if_asked(rank: int, step: int, fault: str = "KILL_AT") -> None:
    """Test-only fault: LOWCOMM_TEST_KILL_AT=RANK:STEP[,...] SIGKILLs that rank after that step;
    the i-th entry fires in launch attempt i (LOWCOMM_ATTEMPT, or torchrun's restart count),
    so a restarted run is killed by the next entry, not again by the same one. `fault`: another
    point to die at, by the same rule (KILL_BEFORE_LOG: train/elastic.py's commit, after the
    snapshot, before the records are written)."""
    if _this_attempts(fault) == (rank, step):
        _note("KILL_LOG", f"{time.time()}")  # when it died, for bench/faults.py's time to notice
        os.kill(os.getpid(), signal.SIGKILL)


def _this_attempts(name: str) -> tuple[int, int] | None:
    """The entry of LOWCOMM_TEST_<name> for this launch attempt (LOWCOMM_ATTEMPT, or torchrun's
    restart count): the i-th fires in attempt i, so a restarted worker is not killed again by it."""
    entries = _fault_spec(name)
    attempt = int(os.environ.get("LOWCOMM_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    return entries[attempt] if attempt < len(entries) else None


def kill_inside_collective_if_asked(comm, rank: int, step: int) -> None:
    """Test-only fault: LOWCOMM_TEST_KILL_IN=RANK:STEP[:FILE][,...] SIGKILLs that rank inside the
    first collective of the strategy's own traffic (not bookkeeping) it issues from that step on:
    the collective is launched, then the rank dies, so its peers are in it waiting for this rank's
    part (a step without one -- diloco's inner steps -- passes it on to the next). With FILE, not
    before FILE exists (a test's sign that what must come first has: a join that failed as its
    group formed, at a load of 30, came back only after the kill, and the faults came apart).
    By launch attempt as KILL_AT; LOWCOMM_TEST_KILL_LOG gets "TIME OP"."""
    entries = [part.split(":", 2) for part in os.environ.get("LOWCOMM_TEST_KILL_IN", "").split(",") if part.strip()]
    attempt = int(os.environ.get("LOWCOMM_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if comm is None or attempt >= len(entries):
        return
    at_rank, at_step, *after = entries[attempt]
    if (int(at_rank) != rank or step < int(at_step) or (after and not os.path.exists(after[0]))
            or getattr(comm._run, "dies", False)):
        return
    run = comm._run

    def dying(op, nbytes, launch, result, async_op, meta=False, local=None):
        if meta:
            return run(op, nbytes, launch, result, async_op, meta, local)
        launch(True)
        _note("KILL_LOG", f"{time.time()} {op}")
        os.kill(os.getpid(), signal.SIGKILL)
    dying.dies = True
    comm._run = dying  # every collective of Comm passes through _run


def nan_loss_if_asked(rank: int, step: int, loss_fn):
    """Test-only fault: LOWCOMM_TEST_NAN_AT=RANK:STEP[,...] makes that rank's loss NaN in that step."""
    if (rank, step) not in _fault_spec("NAN_AT"):
        return loss_fn
    return lambda model, batch: loss_fn(model, batch) * float("nan")


HOLD_LIMIT_S = 3600.0  # a hold's own bound: the test waiting for what it holds for fails sooner (at load 30-38 a
#                       joiner once took over 300 s to start), and releases its holds (:FILE) when it does


def hold_for_joiner_if_asked(step: int, membership: Membership, seen: int = 0, since: int | None = None) -> int:
    """Test-only: LOWCOMM_TEST_HOLD_FOR_JOINER=STEP[,STEP:FILE...] makes every member wait at the
    commit point of each STEP -- the first at or after it, the commits since step `since` (the
    last commit point) having passed it -- until a joiner has announced itself since the `seen`
    joins the members answered (with :FILE, not once FILE exists: the test saw what it waited
    for; and at every later commit point too until FILE exists, so that a joiner the quorum left
    out -- a process starved on a loaded machine misses the lighthouse's heartbeat timeout -- is
    waited for again, not outrun by the run's end), so a test's joiner arrives, or comes back,
    mid-run however loaded the machine is (as the hooks above do for failures). Returns the joins
    seen then, else 0 (a member's own count, not gathered, must not decide alone to re-form)."""
    holds = dict((entry.split(":", 1) + [""])[:2] for entry in
                 os.environ.get("LOWCOMM_TEST_HOLD_FOR_JOINER", "").split(",") if entry)
    since = step - 1 if since is None else since
    due = [at for at in holds if since < int(at) <= step
           or int(at) <= step and holds[at] and not os.path.exists(holds[at])]
    if not due:
        return 0
    unless = holds[due[0]]
    deadline = time.monotonic() + HOLD_LIMIT_S
    while (membership.joins() <= seen and not (unless and os.path.exists(unless))
           and time.monotonic() < deadline):
        membership.progress()  # waiting on purpose: not a stuck worker, whose heartbeats stop
        time.sleep(0.05)
    return membership.joins()


def note_commit_if_asked(slot: int, step: int, state_sha256) -> None:
    """Test-only: LOWCOMM_TEST_COMMIT_HASHES=FILE gets a line {"slot", "step", "sha256"} from each
    member at each of its commits: the hash of the replicated state it committed (`state_sha256`,
    called only when asked: hashing the whole state each commit is a test's cost), so a test
    checks that every member holds the same state after every commit, not only at a re-form."""
    path = os.environ.get("LOWCOMM_TEST_COMMIT_HASHES")
    if path:
        import json
        with open(path, "a") as f:  # one short line a write: appends from several processes stay whole
            f.write(json.dumps({"slot": slot, "step": step, "sha256": state_sha256()}) + "\n")

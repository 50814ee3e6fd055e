"""Elastic replica groups under torchrun: each torchrun job is one replica of K processes.

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 20 --join_timeout_ms 600000 --bind [::]:29510
    torchrun --nproc-per-node 2 --max-restarts 3 -m lowcomm train --elastic --lighthouse HOST:29510 ...  # a replica

As in torchft, the replica is the unit of membership. Only the job's rank 0 (its leader) talks
to the lighthouse: it heartbeats, and at a commit point asks for a quorum with a replica id, its
committed step, K (as the quorum's world_size) and the address of a TCP store it hosts. It hands
each quorum to its K-1 mates through the job's own store (torchrun's MASTER_ADDR:MASTER_PORT),
and every process of every replica in the quorum then makes one gloo default group of R·K
ranks on the first replica's store, rank = replica index·K + its rank in the job; replica_run.py
builds the replica machinery of a plain run (comm/groups.py) on it.

The members learn of a waiting joiner only by asking the lighthouse (there is no shared store
to count joiners in): the leaders' `joins()` ticks every ASK_EVERY_S, the commit gather takes
the highest tick, so every member asks at the same commit point; a quorum of the same replicas,
each still holding the same group, means go on without re-forming (`same` in the plan).
A process whose mate in the job went silent (frozen) exits, so that torchrun restarts the
replica instead of leaving it hanging (MatesWatch).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..errors import RunError
from .address import host_port
from .membership import Membership, View, form_group, leave

ASK_EVERY_S = 2.0    # members ask the lighthouse for a quorum (a joiner may wait) this often, at a commit point
POLL_S = 0.02        # a mate waiting for the leader's plan looks this often
BEAT_S = 0.5         # a process marks itself alive in the job store this often
FIRST_BEAT_S = 60.0  # a mate that never marked itself alive is judged after this long (start-up)
FIRST_QUORUM_S = 300.0  # the first quorum waits this long for --min-workers replicas (they start apart)


@dataclass(frozen=True)
class ReplicaView(View):
    """A quorum of replicas as one process sees it: rank, world, slots and steps are per process."""
    per_replica: int = 1
    ids: tuple[str, ...] = ()

    def shard(self) -> tuple[int, int, int, int]:
        K = self.per_replica
        return self.rank // K, self.world // K, self.rank % K, K

    def size(self) -> int:
        return self.per_replica

    def described(self) -> dict:
        return {"replicas": list(self.ids), "per_replica": self.per_replica}


def plan(quorum, current: ReplicaView | None) -> dict:
    """What every process of every replica makes of one quorum: the same on all of them."""
    members = sorted(quorum.participants, key=lambda m: m.replica_id)
    sizes = sorted({int(m.world_size) for m in members})
    if len(sizes) > 1:
        raise RunError(f"replicas of unequal size in one quorum ({' and '.join(map(str, sizes))} processes): "
                       f"start every torchrun job of an elastic run with the same --nproc-per-node")
    told = [json.loads(m.address) for m in members]
    ids = [m.replica_id for m in members]
    same = (current is not None and ids == list(current.ids)
            and all(t["held"] == current.quorum for t in told))
    return {"quorum": f"{quorum.quorum_id}-{quorum.created.seconds}.{quorum.created.nanos}", "ids": ids,
            "slots": new_slots([t["slot"] for t in told]), "steps": [int(m.step) for m in members],
            "size": sizes[0], "store": members[0].store_address, "same": same}


def new_slots(known: list[int]) -> list[int]:
    """Each replica's number (its processes' slots for per-worker totals and link seeds): a
    replica keeps its own; a new one (-1) takes the next free, in the quorum's order."""
    taken, out = max(known, default=-1), []
    for s in known:
        if s < 0:
            taken += 1
            s = taken
        out.append(s)
    return out


def view_of(p: dict, local: int, replica_id: str) -> ReplicaView:
    K, index = p["size"], p["ids"].index(replica_id)
    return ReplicaView(p["quorum"], index * K + local, len(p["ids"]) * K,
                       tuple(s * K + j for s in p["slots"] for j in range(K)),
                       tuple(s for s in p["steps"] for _ in range(K)), K, tuple(p["ids"]))


def reach_host(url: str) -> str:
    """This machine's address on the route to the lighthouse (where the others reach its store)."""
    host, port = host_port(url)
    family, kind, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(where)  # UDP: no packet is sent, the route is looked up
        return s.getsockname()[0]


class _Side:
    """What the leader and its mates do alike: take a plan, and make (or keep) its group."""

    def _init_side(self, job: dist.Store, local: int, timeout_s: float) -> None:
        self.job, self.local, self.timeout_s = job, local, timeout_s
        self.round, self.current, self._quorum_store = 0, None, None
        self.latest: ReplicaView | None = None  # the plan entered last, formed or forming (a fault's members)
        self.replica_id = ""

    def held(self) -> str:
        """The quorum whose group this process still holds ('' after a rollback destroyed it)."""
        return self.current.quorum if self.current is not None and dist.is_initialized() else ""

    def _enter(self, p: dict) -> ReplicaView:
        if p["same"] and self.current is not None:
            return self.current  # the same replicas, each on the same group: go on, nothing re-formed
        view = self.latest = view_of(p, self.local, self.replica_id)
        leave()
        self.current = None
        host, port = p["store"].rsplit(":", 1)
        self._quorum_store = dist.TCPStore(host.strip("[]"), int(port), is_master=False,
                                           timeout=timedelta(seconds=self.timeout_s))
        form_group(view, self._quorum_store, self.timeout_s)  # on the first replica's store
        self.current = view
        return view

    def alive(self) -> bool:
        """Whether the training thread made progress lately (see Membership.progress)."""
        return self._asking or time.monotonic() - self._progress_at < 2 * self.timeout_s

    def wait_for_first(self, workers: int) -> None:
        """The lighthouse's --min_replicas decides who is in the first quorum."""


class ReplicaLeader(_Side, Membership):
    """The job's rank 0: the replica's member at the lighthouse."""

    def __init__(self, address: str, job: dist.Store, size: int, timeout_s: float, first: int = 1,
                 name: str | None = None, quorum_timeout_s: float = float("inf")):
        self._init_side(job, 0, timeout_s)
        self.quorum_timeout_s = quorum_timeout_s
        self.first = first  # replicas the run's first quorum waits for (--min-workers)
        self.size, self.slot, self.timeout_s = size, -1, timeout_s
        # Ids sort by name (the launcher's slot), else by start time: the replica started first is
        # rank 0 (it writes the run's records). A restarted replica is a new member.
        self.id = self.replica_id = f"{name or f'{time.time_ns():020d}'}:{uuid.uuid4().hex[:8]}"
        self.hosted = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        host = reach_host(address)
        self.store_address = f"[{host}]:{self.hosted.port}" if ":" in host else f"{host}:{self.hosted.port}"
        self.job.set("replica_id", self.id)
        self._ticks_from, self._test_asks = time.monotonic(), 0
        self._start_beats(address)

    def joins(self) -> int:
        """Ask-ticks so far: a higher one seen at a commit point makes every member ask."""
        if self.current is not None and len(self.current.ids) < test_hold()[0]:
            self._test_asks += 1
        return int((time.monotonic() - self._ticks_from) / ASK_EVERY_S) + self._test_asks

    def _ask(self, step: int):
        told = json.dumps({"slot": self.slot, "held": self._held_by_replica()})
        return super()._ask(step, told, self.size)

    def _held_by_replica(self) -> str:
        """The group every process of this replica still holds, or '' when any lost it."""
        mine = self.held()
        for mate in range(1, self.size):
            key = f"held/{self._asking_round}/{mate}"
            if not wait_for(self.job, key, self.timeout_s, self.progress):  # a mate not asking with us: re-form
                return ""
            if self.job.get(key).decode() != mine:
                return ""
        return mine

    def agree(self, step: int, joining: bool = False) -> ReplicaView:
        self._asking_round, self.round = self.round, self.round + 1
        self._asking = True  # alive while a quorum request blocks
        try:
            q = self._quorum(step)
            want, after = test_hold()
            want = self.first if self.current is None and not joining else want if step >= after else 0
            q = hold(q, want, step, self._quorum)
        finally:
            self.progress()
            self._asking = False
        p = plan(q, self.current)
        if joining and max(p["steps"]) < 0:  # it would start the run over, alone
            raise RunError("no replica of the run holds its state (every member of the quorum is joining): the run "
                           "ended or lost every replica; its records are in the --out of the job that held rank 0")
        self.slot = p["slots"][p["ids"].index(self.id)]
        self.job.set(f"plan/{self._asking_round}", json.dumps(p))
        return self._enter(p)


class ReplicaPeer(_Side):
    """Rank 1..K-1 of a job: each quorum comes from the leader, through the job's store."""

    def __init__(self, job: dist.Store, local: int, timeout_s: float):
        self._init_side(job, local, timeout_s)
        self._progress_at, self._asking = time.monotonic(), False

    def progress(self) -> None:
        self._progress_at = time.monotonic()

    def joins(self) -> int:
        return 0

    def agree(self, step: int, joining: bool = False) -> ReplicaView:
        n, self.round = self.round, self.round + 1
        self.job.set(f"held/{n}/{self.local}", self.held())
        key = f"plan/{n}"
        self._asking = True
        try:  # the leader may wait long for a quorum (a joiner waits for the members' next ask)
            wait_for(self.job, key, float("inf"), self.progress)
        finally:
            self.progress()
            self._asking = False
        if not self.replica_id:
            self.replica_id = self.job.get("replica_id").decode()
        return self._enter(json.loads(self.job.get(key)))

    def close(self) -> None:
        leave()


def wait_for(store: dist.Store, key: str, within_s: float, alive) -> bool:
    """Whether `key` appeared in `store` within `within_s`: polled, not store.wait, whose
    timeouts c10d logs as warnings (a joiner's mates would log them for minutes)."""
    deadline = time.monotonic() + within_s
    while not store.check([key]):
        alive()
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def test_hold() -> tuple[int, int]:
    """Test-only: LOWCOMM_TEST_HOLD_FOR_REPLICAS=N:STEP makes a leader with fewer than N replicas
    ask at every commit point and, past STEP, ask again until its quorum has N, so a test's
    restarted replica joins mid-run however loaded the machine is. (0, 0) otherwise."""
    spec = os.environ.get("LOWCOMM_TEST_HOLD_FOR_REPLICAS")
    want, after = (int(x) for x in spec.split(":")) if spec else (0, 0)
    return want, after


def hold(q, want: int, step: int, ask):
    """Ask again until the quorum holds `want` replicas. The others are let in as joiners are:
    a replica that asks while this one does not waits (the lighthouse's fast quorum needs every
    member of the previous quorum), and is in the next quorum this one asks for."""
    deadline = time.monotonic() + FIRST_QUORUM_S
    while len(q.participants) < want:
        if time.monotonic() > deadline:
            raise RunError(f"only {len(q.participants)} of {want} replicas (--min-workers) asked the lighthouse for "
                           f"a quorum within {FIRST_QUORUM_S:.0f} s")
        time.sleep(0.1)
        q = ask(step)
    return q


class MatesWatch:
    """Each process of a job marks itself alive in the job store; one that sees a mate silent
    past the member timeout exits non-zero, and torchrun's agent then stops and restarts the
    whole replica (with --max-restarts), instead of it hanging on a frozen process."""

    def __init__(self, job: dist.Store, local: int, size: int, timeout_s: float, alive):
        self.job, self.local, self.size, self.timeout_s, self.alive = job, local, size, timeout_s, alive
        self._stop = threading.Event()
        self.job.set(f"pid/{local}", f"{socket.gethostname()}:{os.getpid()}")
        threading.Thread(target=self._watch, name="lowcomm-mates", daemon=True).start()

    def _watch(self) -> None:
        start = time.monotonic()
        seen = {m: (-1, start) for m in range(self.size) if m != self.local}
        while not self._stop.wait(BEAT_S):
            try:
                if self.alive():
                    self.job.add(f"beat/{self.local}", 1)
                for mate, (count, at) in seen.items():
                    now, beats = time.monotonic(), int(self.job.add(f"beat/{mate}", 0))
                    if beats != count:
                        seen[mate] = (beats, now)
                    elif self.job.check([f"done/{mate}"]):
                        continue
                    elif now - at > (self.timeout_s if count > 0 else max(self.timeout_s, FIRST_BEAT_S)):
                        self._stop_replica(mate, now - at)
            except Exception:  # the job's store is gone (its host process ended): torchrun ends the job
                return

    def _stop_replica(self, mate: int, silent_s: float) -> None:
        """Exit non-zero, the silent mate killed first where it runs on this host: torchrun's
        agent stops a job with SIGTERM, which a frozen (SIGSTOPped) process takes only when
        continued, so the agent would wait its 30 s grace before its SIGKILL."""
        print(f"error: process {mate} of this replica has been silent for {silent_s:.0f} s (--member-timeout "
              f"{self.timeout_s:g} s); stopping the replica so that torchrun restarts it", file=sys.stderr, flush=True)
        host, pid = self.job.get(f"pid/{mate}").decode().rsplit(":", 1)
        if host == socket.gethostname():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:  # gone already
                pass
        os._exit(1)

    def done(self) -> None:
        self._stop.set()
        try:
            self.job.set(f"done/{self.local}", "1")
        except Exception:
            pass

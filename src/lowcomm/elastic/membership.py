"""A worker's membership: heartbeats, a quorum at a commit point, the c10d group of its members.

Each worker has an id that sorts by its slot (the launcher's worker number), so the members of
a quorum take ranks in slot order and the lowest live slot is rank 0 (it writes steps.jsonl).
A quorum's group is a plain gloo default group made on the launcher's TCP store under a prefix
unique to that quorum: the previous group is destroyed first, so everything lowcomm builds on
the default group (Comm, DDP, the control groups) works unchanged on each membership.
"""
from __future__ import annotations

import gc
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..comm import control
from ..errors import NoQuorum, RunError
from . import lighthouse

JOINS = "lowcomm/elastic/joins"        # a joiner adds 1: the members ask for a quorum at their next commit
STARTED = "lowcomm/elastic/started"    # each first worker adds 1: the first quorum holds all of them
QUORUM_RPC_S = 5.0                     # one quorum request; repeated until the lighthouse answers
LIGHTHOUSE_AWAY_S = 60.0               # a lighthouse unreachable this long (not restarted): the worker fails
REANNOUNCE_S = 2.0                     # a waiting joiner announces itself again (it may have missed a quorum)
QUORUM_QUIET_S = 60.0                  # a quorum this long in coming: the worker says what the lighthouse waits for
#                                        (and again every QUORUM_QUIET_S, up to --quorum-timeout)
STORE_QUIET_S = 20.0                   # a new group this long in forming on the launcher's store: said once
STORE_TIMEOUT_S = 300.0                # the launcher's store unanswered this long: the worker fails
ARRIVED = "arrived"                    # on a quorum's prefix: how many of its members reached form_group
FORM_FACTOR, FORM_MIN_S = 6.0, 60.0    # how long a quorum's members wait for each other before connecting
JOINS_POLL_S = 0.2                     # how often a member reads the joiners' count (joins())
CLOSE_JOIN_S = 3.0                     # close() waits this long for its threads' last call (a beat: 1 s at most)


@dataclass(frozen=True)
class View:
    """One quorum, as this worker sees it."""
    quorum: str
    rank: int
    world: int
    slots: tuple[int, ...]   # each rank's slot
    steps: tuple[int, ...]   # each rank's committed step when it asked

    def shard(self) -> tuple[int, int, int, int]:
        """Which data this rank reads (loader.ShardedBatches' rank, world, position, positions):
        one worker is one shard here; a replica of K processes (replicas.py) splits its shard."""
        return self.rank, self.world, 0, 1

    def size(self) -> int:
        """Ranks per replica: one here (a worker is its own replica)."""
        return 1

    def described(self) -> dict:
        """What membership.jsonl records beyond the slots (replicas.py: the replicas)."""
        return {}


class Membership:
    speaks = True  # says so when a quorum is long in coming (the launcher's workers: slot 0 alone)

    latest: View | None = None  # the last quorum agreed on, formed or still forming (a fault's members)
    quorum_timeout_s = float("inf")  # the run's --quorum-timeout (Waiting); unbounded unless told

    def __init__(self, address: str, store_host: str, store_port: int, slot: int, timeout_s: float,
                 speaks: bool = True, quorum_timeout_s: float = float("inf")):
        self.slot, self.timeout_s, self.speaks, self.quorum_timeout_s = slot, timeout_s, speaks, quorum_timeout_s
        self.id = f"{slot:05d}:{uuid.uuid4().hex[:8]}"  # a restarted worker is a new member
        self.store_address = f"{store_host}:{store_port}"
        self.store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
        self._start_beats(address)
        self._joins = 0
        # The joiners' count is read beside training, on a client of its own: a commit reads the
        # latest count and never waits on the launcher's store (a stopped launcher stalled every
        # commit until the store's timeout). A re-form still needs the store (form_group).
        self._joins_store = dist.TCPStore(store_host, store_port, is_master=False,
                                          timeout=timedelta(seconds=STORE_TIMEOUT_S))
        self._threads.append(threading.Thread(target=self._read_joins, name="lowcomm-joins", daemon=True))
        self._threads[-1].start()

    def _start_beats(self, address: str) -> None:
        """Clients of the lighthouse, a first heartbeat, and the heartbeat thread."""
        self.address = address
        self._stop = threading.Event()
        # Healthy before the first quorum is asked for (see wait_for_first). A lighthouse that is
        # stalled or restarting (a restarted worker meets one after a host's hiccup) is waited
        # for as a quorum request waits for it, not a death that uses up a restart.
        self._client, self._beats = self._retry_while_away(self._first_beat, "its first heartbeat")
        self._beat_failed, self._beats_back_at = False, 0.0  # see settling()
        self._progress_at, self._asking = time.monotonic(), False  # see progress()
        self._beater = lighthouse.BeatsProcess(address, self.id)  # beats that need no interpreter lock
        self._threads = [threading.Thread(target=self._heartbeat, name="lowcomm-heartbeat", daemon=True)]
        self._threads[-1].start()

    def _first_beat(self):
        client, beats = lighthouse.client(self.address), lighthouse.client(self.address)  # one client a thread
        beats.heartbeat(self.id, timeout=timedelta(seconds=QUORUM_RPC_S))
        return client, beats

    def _retry_while_away(self, call, what: str):
        """call() until the lighthouse answers it; RunError, one line naming the lighthouse, when it
        has not for LIGHTHOUSE_AWAY_S (torchft's gRPC text only at its end)."""
        since = time.monotonic()
        while True:
            try:
                return call()
            except Exception as e:
                if not (lighthouse_away(e) or waiting_for_peers(e)):
                    raise
                if time.monotonic() - since > LIGHTHOUSE_AWAY_S:
                    raise RunError(f"the lighthouse at {self.address} did not answer {what} for "
                                   f"{LIGHTHOUSE_AWAY_S:.0f} s (torchft: {' '.join(str(e).split())[:120]})") from None
            self.progress()
            time.sleep(lighthouse.HEARTBEAT_S)

    def _read_joins(self) -> None:
        while not self._stop.wait(JOINS_POLL_S):
            try:
                self._joins = max(self._joins, int(self._joins_store.add(JOINS, 0)))
            except Exception:  # the launcher's store is gone: the run is ending, or a re-form will say so
                return

    def progress(self) -> None:
        """The training thread is alive (called each step and while it waits for a quorum).
        Without it for twice the member timeout, heartbeats stop: a worker whose training thread
        is stuck (a deadlock, a hung kernel) while this thread runs on is then dropped by the
        lighthouse too, as a frozen one is, instead of the lighthouse waiting for it to ask for
        a quorum (for JOIN_TIMEOUT_MS)."""
        self._progress_at = time.monotonic()

    def _heartbeat(self) -> None:
        while not self._stop.wait(lighthouse.HEARTBEAT_S):
            if not self._asking and time.monotonic() - self._progress_at > 2 * self.timeout_s:
                self._beater.stop()
                continue
            self._beater.keep()
            try:
                # A beat outliving the lighthouse's heartbeat timeout is worthless: give up on it
                # then, so that beats resume at once when a stopped lighthouse is restarted.
                self._beats.heartbeat(self.id, timeout=timedelta(milliseconds=lighthouse.HEARTBEAT_TIMEOUT_MS))
            except Exception:  # the lighthouse is briefly unreachable: the next beat retries
                self._beat_failed = True
                continue
            if self._beat_failed:
                self._beat_failed, self._beats_back_at = False, time.monotonic()
        self._beater.close()  # closed: one that a last keep() above restarted, too

    def settling(self) -> bool:
        """Whether the lighthouse may not yet know every live worker: it is away, or came back
        (restarted, it knows only the workers that have beaten since) less than a heartbeat
        timeout ago. A quorum asked for then could leave out a live worker whose beat is on its way."""
        return self._beat_failed or time.monotonic() - self._beats_back_at < lighthouse.HEARTBEAT_TIMEOUT_MS / 1000

    def wait_for_first(self, workers: int) -> None:
        """The run's first workers wait for each other, so that the first quorum holds them all."""
        self.store.add(STARTED, 1)
        deadline = time.monotonic() + 300
        while int(self.store.add(STARTED, 0)) < workers:
            self.progress()
            if time.monotonic() > deadline:
                raise RunError(f"only {int(self.store.add(STARTED, 0))} of {workers} workers started within 300 s")
            time.sleep(0.02)

    def joins(self) -> int:
        """How many times a joiner announced itself (compared at commit points), as last read:
        at the last quorum (agree), or since by the reading thread."""
        return self._joins

    def agree(self, step: int, joining: bool = False) -> View:
        """Ask for a quorum (this worker's committed step with it), then form its group."""
        done, failed = threading.Event(), []
        announcer = threading.Thread(target=self._announce, args=(done, failed), daemon=True)
        if joining:  # say so until a quorum takes us: the members ask only when told
            announcer.start()
        self._asking = True  # alive while a quorum request blocks (up to QUORUM_RPC_S)
        try:
            q = self._quorum(step)
        finally:
            self.progress()
            self._asking = False
            done.set()
        members = sorted(q.participants, key=lambda m: m.replica_id)
        ids = [m.replica_id for m in members]
        if self.id not in ids:
            raise RunError(f"the lighthouse's quorum {q.quorum_id} left this worker out")
        view = self.latest = View(f"{q.quorum_id}-{q.created.seconds}.{q.created.nanos}", ids.index(self.id), len(ids),
                                  tuple(int(i.split(":")[0]) for i in ids), tuple(int(m.step) for m in members))
        # An announcement of ours in flight and the new group both wait on the launcher's store (a
        # stopped launcher): said past STORE_QUIET_S by the quorum's rank 0 (slot 0 may be the one
        # lost), not silent until the store's timeout.
        with self._store_waits(speaks=self.speaks or view.rank == 0):
            if joining:  # every announcement of ours lands before the members compare counts
                announcer.join()
            if failed:
                raise RunError(f"the launcher's store at {self.store_address} did not take this worker's "
                               f"announcement: {' '.join(str(failed[0]).split())[:160]}")
            leave()
            form_group(view, self.store, self.timeout_s)
        # Every announcement of a joiner this quorum took landed before it formed its group (above):
        # read now, every member counts them, so no later commit takes them for a new joiner.
        self._joins = max(self._joins, int(self.store.add(JOINS, 0)))
        return view

    @contextmanager
    def _store_waits(self, speaks: bool):
        """A wait on the launcher's store: a commit never waits on it, but a re-form does (a
        stopped launcher, or a member of the quorum that never arrives), so a wait past
        STORE_QUIET_S is said once instead of lasting silently up to STORE_TIMEOUT_S."""
        said = threading.Timer(STORE_QUIET_S, self._say_the_store_waits) if speaks else None
        if said is not None:
            said.daemon = True
            said.start()
        try:
            yield
        finally:
            if said is not None:
                said.cancel()

    def _say_the_store_waits(self) -> None:
        print(f"lowcomm: worker {self.slot} has waited {STORE_QUIET_S:.0f} s to form the new quorum's group on "
              f"the launcher's store at {self.store_address} (a stopped launcher, or a member that has not "
              f"arrived); it gives up after {STORE_TIMEOUT_S:.0f} s", file=sys.stderr, flush=True)

    def _announce(self, done: threading.Event, failed: list) -> None:
        while not done.wait(0.2):
            try:
                self.store.add(JOINS, 1)
            except Exception as e:  # the store's timeout (STORE_TIMEOUT_S): agree() says so
                failed.append(e)
                return
            if done.wait(REANNOUNCE_S):
                return

    def _quorum(self, step: int):
        away_since, why = None, "its heartbeats failed"
        waiting = Waiting(self, bounded=step >= 0)
        while True:
            if not self.settling():
                try:
                    return self._ask(step)
                except Exception as e:
                    if waiting_for_peers(e):  # no quorum yet (too few workers): ask again
                        away_since = None
                        waiting.check()
                        continue
                    if not lighthouse_away(e):
                        raise
                    why = str(e)
            # The lighthouse is down or restarting (the launcher restarts it): ask again, for a while.
            away_since = away_since or time.monotonic()
            if time.monotonic() - away_since > LIGHTHOUSE_AWAY_S:
                raise RunError(f"the lighthouse did not answer for {LIGHTHOUSE_AWAY_S:.0f} s: {why}")
            time.sleep(lighthouse.HEARTBEAT_S)

    def _ask(self, step: int, told: str = "", world_size: int = 1):
        """One quorum request to the lighthouse (blocks up to QUORUM_RPC_S); `told`: what the
        other members read of this one, `world_size`: its processes (replicas.py)."""
        return self._client.quorum(replica_id=self.id, timeout=timedelta(seconds=QUORUM_RPC_S), address=told,
                                   store_address=self.store_address, step=step, world_size=world_size,
                                   shrink_only=False)

    def close(self) -> None:
        """Stop beating and reading; the heartbeat and joins threads are waited for (up to
        CLOSE_JOIN_S): one still inside a heartbeat RPC or a store read when the interpreter
        finalizes is ended by pthread_exit through C++ frames as it comes back for the interpreter
        lock, and the process aborts ("terminate called without an active exception", seen at load)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=CLOSE_JOIN_S)
        self._beater.close()
        leave()


class Waiting:
    """A quorum long in coming (too few live workers for the lighthouse's --min_replicas, for
    good: no restart left, or an external lighthouse asking for more than the run has): every
    QUORUM_QUIET_S the worker says so, with the lighthouse's own line on what its next quorum
    lacks (its participants, its min_replicas, those heartbeating). A member holding the run's
    state (`bounded`) fails the run past --quorum-timeout (NoQuorum, one line); a fresh process
    (a joiner) may wait longer, for the members' next commit point, and is ended with the run."""

    def __init__(self, member: "Membership", bounded: bool = True, clock=time.monotonic):
        self.member, self.bounded, self.clock = member, bounded, clock
        self.since, self.next_line = clock(), QUORUM_QUIET_S

    def check(self) -> None:
        waited, limit = self.clock() - self.since, self.member.quorum_timeout_s
        who = f"worker {self.member.slot}" if self.member.slot >= 0 else "this replica"
        if self.bounded and waited > limit:
            raise NoQuorum(f"{who} had no quorum for {waited:.0f} s (--quorum-timeout {limit:g}); the lighthouse "
                           f"at {self.member.address} says: {self._status()}")
        if waited < self.next_line or not self.member.speaks:
            return
        self.next_line = waited + QUORUM_QUIET_S
        ends = f"; the run fails after {limit:g} s without one (--quorum-timeout)" if self.bounded else ""
        print(f"lowcomm: {who} has waited {waited:.0f} s for a quorum; the lighthouse at {self.member.address} "
              f"says: {self._status()}{ends}", file=sys.stderr, flush=True)

    def _status(self) -> str:
        from .address import lighthouse_status
        try:
            return lighthouse_status(self.member.address) or "no line on its next quorum"
        except OSError as e:
            return str(e)


def form_group(view: View, store: dist.Store, timeout_s: float, arrive_s: float | None = None) -> None:
    """The quorum's gloo default group, on `store` under a prefix unique to the quorum, and the
    driver's control group beside it, both failing a collective after `timeout_s` (a frozen
    member fails the others'; new_group's own timeout is 30 min). The previous group is left first.

    gloo's connect waits for every member's address only `timeout_s` (the collective timeout it
    is given), and a member of a new quorum may still be leaving its old group, collecting
    garbage or restoring state: on a loaded machine (load 30+) a member 10 s late failed the
    group's forming again and again until the run gave up. So the members first wait for each
    other on the store, up to `arrive_s` (default: FORM_FACTOR x `timeout_s`, at least
    FORM_MIN_S), and connect only once all have arrived."""
    prefix = dist.PrefixStore(f"lowcomm/elastic/q{view.quorum}/", store)
    wait_for_members(prefix, view.world, arrive_s if arrive_s is not None else max(FORM_MIN_S, FORM_FACTOR * timeout_s))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=prefix, rank=view.rank, world_size=view.world, timeout=timeout)
    control.register_control(dist.group.WORLD, dist.new_group(backend="gloo", timeout=timeout))


def wait_for_members(store: dist.Store, world: int, bound_s: float, poll_s: float = 0.01) -> None:
    """Every one of the quorum's `world` members has reached its forming (each adds 1 to a count
    on the quorum's own prefix); TimeoutError (what a lost peer raises: the quorum is asked again)
    when some have not within `bound_s`."""
    store.add(ARRIVED, 1)
    deadline = time.monotonic() + bound_s
    while (arrived := int(store.add(ARRIVED, 0))) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of the quorum's {world} members reached its group "
                               f"within {bound_s:g} s (timed out)")
        time.sleep(poll_s)


def waiting_for_peers(e: BaseException) -> bool:
    """A quorum request that timed out (the lighthouse answered no quorum in time, or was frozen)."""
    text = str(e).lower()
    return isinstance(e, TimeoutError) or any(m in text for m in ("timeout", "timed out", "deadline"))


def lighthouse_away(e: BaseException) -> bool:
    """How torchft's client reports a lighthouse it cannot reach (gRPC Unavailable: no connection;
    Unknown "transport error": the connection dropped mid-request, the lighthouse died)."""
    text = str(e).lower()
    return any(m in text for m in ("connect", "unavailable", "transport error", "broken pipe", "reset"))


def leave() -> None:
    """Destroy this worker's group, if any (collected first: see worker.leave_group), and the
    control groups made beside it. Collected again after: a group is freed -- its sockets closed,
    so a survivor blocked on this member fails at once -- when its last reference goes, and that
    must be here, on this thread: freed in a garbage collection that a Python callback sets off on
    one of gloo's own threads (DDP's comm hooks: PowerSGD), it would join its own thread ("terminate
    called ... Resource deadlock avoided", seen once in a joiner continued after a SIGSTOP). (Keeping
    every group instead cost each kill the whole --member-timeout: shutdown() leaves the sockets open.)"""
    control.forget_control_groups()
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()

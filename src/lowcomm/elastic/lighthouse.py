"""torchft's lighthouse: the one place that decides who is in the run.

Every worker heartbeats to it (HEARTBEAT_S); at a commit point the workers ask it for a quorum
and it answers every one of them with the same members. A worker whose heartbeats stop for
HEARTBEAT_TIMEOUT_MS (a SIGKILL, a crash) is left out of the next quorum. The launcher runs it
in its own process and restarts it there when it dies (keeper.py).

Why the lighthouse and not torchft's Manager: the Manager's process groups are torchft's own
wrappers, which c10d does not know (dist.get_rank, DDP's reducer and lowcomm's control groups
need a registered group), it asks for a quorum on every step (an RPC round a step), and it sends
state over HTTP; lowcomm asks only at commit points, runs each membership on a plain c10d gloo
group made from the quorum (membership.py) and sends state over that group (transfer.py).
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

from ..errors import UsageError

HEARTBEAT_S = 0.1
HEARTBEAT_TIMEOUT_MS = 1000   # a dead worker is dropped this long after its last heartbeat
# The lighthouse may form a quorum without a worker that heartbeats but has not asked for one
# only after this long: the live members ask at their next commit point, so it must be longer
# than a commit interval, or a joiner could form a quorum of its own.
JOIN_TIMEOUT_MS = 600_000
QUORUM_TICK_MS = 20


def _torchft():
    """torchft's native module, its logging kept to warnings (it logs every quorum at INFO)."""
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft._torchft
    return torchft._torchft


def require_torchft() -> None:
    try:
        _torchft()
    except ImportError:
        raise UsageError("--elastic needs torchft: pip install 'lowcomm[elastic]' (torchft==0.2.0)") from None


def start(min_workers: int):
    """The lighthouse server, on a free port, in its own process and restarted there when it dies
    (keeper.py); `.address()` is what workers connect to."""
    from .keeper import KeptLighthouse
    return KeptLighthouse(min_workers, JOIN_TIMEOUT_MS, QUORUM_TICK_MS, HEARTBEAT_TIMEOUT_MS)


def client(address: str):
    return _torchft().LighthouseClient(addr=address, connect_timeout=timedelta(seconds=30))


class NativeBeats:
    """A worker's heartbeats sent from torchft's native threads (a ManagerServer of its own, used
    for nothing else), beside the Python heartbeat thread's: a Python thread beats only when it
    gets the interpreter's lock, which another thread may hold for seconds at a time on a loaded
    machine (gc.collect() and destroy_process_group() as a quorum re-forms, an import, a long C
    call), and the lighthouse then left a live member out of the quorum (at a load of 20-38 on 2
    cores: a joiner, in the fault matrix). A killed or SIGSTOPped process still stops beating at
    once, so HEARTBEAT_TIMEOUT_MS stays short. The Membership stops these beats (stop()) when its
    training thread is stuck, and keep()s them going otherwise; they ride out a lighthouse restart."""

    def __init__(self, address: str, replica_id: str):
        self.address, self.replica_id = address, replica_id
        self._lock = threading.Lock()
        self._server, self._starting, self._wanted = None, False, False

    def keep(self) -> None:
        """Beating, or starting to: the start waits for the lighthouse's answer (up to a heartbeat
        timeout), so it runs on a thread of its own, never on the caller's."""
        with self._lock:
            self._wanted = True
            if self._server is not None or self._starting:
                return
            self._starting = True
        threading.Thread(target=self._start, name="lowcomm-native-beats", daemon=True).start()

    def _start(self) -> None:
        try:
            server = _torchft().ManagerServer(
                replica_id=self.replica_id, lighthouse_addr=self.address, hostname="localhost", bind="127.0.0.1:0",
                store_addr="", world_size=1, heartbeat_interval=timedelta(seconds=HEARTBEAT_S),
                connect_timeout=timedelta(milliseconds=HEARTBEAT_TIMEOUT_MS), quorum_retries=0)
        except Exception:  # the lighthouse away (or not torchft's): the next keep() tries again
            server = None
        with self._lock:
            self._starting = False
            if self._wanted:
                self._server, server = server, None
        if server is not None:  # stopped while it started
            server.shutdown()

    def stop(self) -> None:
        with self._lock:
            self._wanted, server, self._server = False, self._server, None
        if server is not None:
            server.shutdown()

"""torchft's lighthouse: the one place that decides who is in the run.

Every worker heartbeats to it (HEARTBEAT_S; from a thread, and from a process of its own:
BeatsProcess); at a commit point the workers ask it for a quorum
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
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

from ..errors import UsageError

HEARTBEAT_S = 0.1
HEARTBEAT_TIMEOUT_MS = 1000   # a dead worker is dropped this long after its last heartbeat
# The lighthouse may form a quorum without a worker that heartbeats but has not asked for one
# only after this long: the live members ask at their next commit point, so it must be longer
# than a commit interval, or a joiner could form a quorum of its own.
JOIN_TIMEOUT_MS = 600_000
QUORUM_TICK_MS = 20
BEATS = Path(__file__).with_name("beats_serve.py")


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


class BeatsProcess:
    """A worker's heartbeats sent from a small process of its own (beats_serve.py), beside the
    worker's Python heartbeat thread: a thread beats only when it gets the interpreter's lock,
    which another thread may hold for seconds at a time on a loaded machine (gc.collect() and
    destroy_process_group() as a quorum re-forms, an import, a long C call), and the lighthouse
    then left a live member out of a quorum (at a load of 20-38 on 2 cores: a joiner, in the
    fault matrix). A killed or SIGSTOPped worker still stops beating at once, so
    HEARTBEAT_TIMEOUT_MS stays short. The Membership stop()s these beats when its training thread
    is stuck and keep()s them going otherwise. Where /proc is missing (a stopped worker could not
    be told), there is no such process: the thread's beats alone, as before."""

    def __init__(self, address: str, replica_id: str):
        self.address, self.replica_id = address, replica_id
        self._proc: subprocess.Popen | None = None
        self._beating = False
        self._usable = os.path.isdir("/proc/self")
        self._lock = threading.Lock()  # the heartbeat thread says, the worker's close() ends

    def keep(self) -> None:
        with self._lock:
            self._say(True)

    def stop(self) -> None:
        with self._lock:
            self._say(False)

    def _say(self, beating: bool) -> None:
        if not self._usable or (beating == self._beating and (self._proc is None or self._proc.poll() is None)):
            return
        try:
            if self._proc is None or self._proc.poll() is not None:
                if not beating:
                    return
                self._proc = subprocess.Popen(
                    [sys.executable, str(BEATS), self.address, self.replica_id, str(HEARTBEAT_S),
                     str(HEARTBEAT_TIMEOUT_MS)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            self._proc.stdin.write("1\n" if beating else "0\n")
            self._proc.stdin.flush()
            self._beating = beating
        except OSError:  # it ended meanwhile: started again at the next keep()
            self._beating = False

    def close(self) -> None:
        """End the process (closing its pipe ends it; a worker killed closes it the same way)."""
        with self._lock:
            proc, self._proc, self._usable = self._proc, None, False
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

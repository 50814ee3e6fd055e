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

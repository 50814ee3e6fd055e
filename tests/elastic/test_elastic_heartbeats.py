"""A live member keeps beating while its interpreter's lock is held: its heartbeats go out from a
process of their own too (elastic/lighthouse.py, BeatsProcess), so a worker that holds the lock
for seconds (gc.collect() and destroy_process_group() as a quorum re-forms, an import, a long C
call, all stretched by a loaded machine) is not taken for dead by the lighthouse, whose timeout
stays short (a killed worker is dropped about a second after its last beat)."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

import torch.distributed as dist  # noqa: E402

from lowcomm.elastic import lighthouse  # noqa: E402
from lowcomm.elastic.address import lighthouse_status  # noqa: E402
from elastic_runs import wait_for  # noqa: E402

HOLD_S = 3.0  # of CPU time, the lock held throughout: three heartbeat timeouts
# A member that holds the lock HOLD_S in one C call (sum over a range never lets it go), saying
# when (wall clock) it took and let go of it.
HOLDER = """
import sys, time
from lowcomm.elastic.membership import Membership
m = Membership(sys.argv[1], "127.0.0.1", int(sys.argv[2]), slot=0, timeout_s=30.0)
time.sleep(1.0)  # its beats under way
t = time.process_time(); sum(range(10**6)); per = (time.process_time() - t) / 10**6
start = time.time()
sum(range(int(float(sys.argv[3]) / per)))
print("held", start, time.time(), flush=True)
m.close()
"""


def heartbeating(address: str) -> int:
    return int(re.search(r"\[(\d+) heartbeating\]", lighthouse_status(address)).group(1))


@pytest.mark.elastic
def test_a_member_holding_its_interpreter_lock_for_seconds_keeps_beating():
    server = lighthouse.start(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, server.address(), str(store.port), str(HOLD_S)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: heartbeating(server.address()) == 1, "the member's first beats")
        seen = []  # (when, heartbeating) until the member says how long it held the lock
        while child.poll() is None:
            seen.append((time.time(), heartbeating(server.address())))
            time.sleep(0.05)
        out = child.stdout.read()
        held = re.search(r"held (\S+) (\S+)", out)
        assert child.returncode == 0 and held, out
        start, end = map(float, held.groups())
        # past a heartbeat timeout into the hold, until it ends: a Python thread's beats had
        # stopped there (0 heartbeating), those of the beats' own process go on
        timeout_s = lighthouse.HEARTBEAT_TIMEOUT_MS / 1000
        during = [n for when, n in seen if start + 1.5 * timeout_s < when < end - 0.2]
        assert during and all(n == 1 for n in during), (end - start, seen)
    finally:
        child.kill()
        server.shutdown()


class BlockedBeats:
    """A lighthouse client whose next heartbeat call blocks until released: the heartbeat thread
    is inside its call (a native RPC in torchft's client) when the member closes."""

    def __init__(self):
        self.inside, self.release = threading.Event(), threading.Event()

    def heartbeat(self, *args, **kwargs):
        self.inside.set()
        self.release.wait(10)


@pytest.mark.elastic
def test_closing_waits_for_a_heartbeat_in_flight():
    """A thread still inside a native call when the interpreter finalizes aborts the process as it
    comes back ("terminate called without an active exception": the heartbeat test's member, at
    load). close() returns only once its threads have ended: forced here by a beat that blocks."""
    from lowcomm.elastic.membership import Membership

    server = lighthouse.start(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    member = Membership(server.address(), "127.0.0.1", store.port, slot=0, timeout_s=30.0)
    try:
        beats = member._beats = BlockedBeats()
        assert beats.inside.wait(10), "the heartbeat thread's next beat"
        closing = threading.Thread(target=member.close)
        closing.start()
        closing.join(0.5)
        assert closing.is_alive()  # waiting for the beat in flight
        beats.release.set()
        closing.join(10)
        assert not closing.is_alive()
        left = [t.name for t in threading.enumerate() if t.name in ("lowcomm-heartbeat", "lowcomm-joins")]
        assert left == []
    finally:
        beats.release.set()
        server.shutdown()

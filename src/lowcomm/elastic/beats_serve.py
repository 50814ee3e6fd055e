"""A worker's heartbeats from a process of their own: torchft's heartbeat to the lighthouse every
HEARTBEAT_S for the worker that started it, while that worker lives, runs (not SIGSTOPped) and
says its training thread makes progress (a line "1" on stdin; "0": stuck, stop beating).

Why a process: a thread of the worker beats only when it gets the interpreter's lock, which
another thread may hold for seconds at a time on a loaded machine (gc.collect() and
destroy_process_group() as a quorum re-forms, an import, a long C call), and the lighthouse then
leaves a live worker out of a quorum. This process holds no lock anyone else wants; it sleeps
between beats, so it wakes on time however busy the machine is. A worker killed closes the pipe
(this process ends at once); a worker stopped is seen in /proc (its state T): no beat is sent for
it, so both are dropped a heartbeat timeout after, as before.

Run by its path (keeper.py's reason: no import of torch):
    python beats_serve.py ADDRESS REPLICA_ID HEARTBEAT_S TIMEOUT_MS
"""
import os
import select
import sys
from datetime import timedelta

from lighthouse_serve import native


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger), as /proc says."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def main(argv: list[str]) -> None:
    address, replica_id, every_s, timeout_ms = argv[0], argv[1], float(argv[2]), int(argv[3])
    worker, beating, client = os.getppid(), True, None
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], every_s)
        if ready:
            line = sys.stdin.readline()
            if not line:  # the worker is gone
                return
            beating = line.strip() == "1"
        if beating and os.getppid() == worker and not stopped(worker):
            try:  # connected once (a loaded machine may take seconds), then a beat each time
                client = client or native().LighthouseClient(addr=address, connect_timeout=timedelta(seconds=30))
                client.heartbeat(replica_id, timeout=timedelta(milliseconds=timeout_ms))
            except Exception:  # the lighthouse briefly away: the next beat retries
                pass


if __name__ == "__main__":
    main(sys.argv[1:])

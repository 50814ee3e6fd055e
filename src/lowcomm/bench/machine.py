"""The machine a bench ran on: its cores and load, recorded in bench.json, and said at the start
when the bench's workers will share cores.

Why: the workers of a CPU bench are processes on one host. With more worker threads than cores
(or a load above the cores) they take turns on the cores, and what a run measures as compute is
then partly waiting for a core -- more for a strategy whose workers never wait for each other
than for one that waits in a collective each step. A calibration taken so (`lowcomm plan
--calibrate`) prices that contention as compute; the plan names it (metrics/calibration.py)
instead of claiming its step times.
"""
from __future__ import annotations

from ..launch.resources import device_type
from ..metrics.calibration import cpu_cores, load, shared_cores


def at_start(cfgs: list) -> dict:
    """bench.json's "machine" at the start of a bench of runs `cfgs`, after the line that says its
    workers will share the cores (printed) when they will. `threads`: the most worker threads any
    run puts on the cores (0 where they all compute on a GPU)."""
    threads = max((c.workers * c.threads for c in cfgs if device_type(c) == "cpu"), default=0)
    machine = {"cores": cpu_cores(), "load_at_start": load(), "threads": threads}
    busy = shared_cores(threads, machine["cores"], machine["load_at_start"])
    if busy:
        print(f"bench: {busy}: the compute it measures will include waiting for a core, so `lowcomm "
              f"plan --calibrate` on this bench does not claim its step times", flush=True)
    return machine

"""The flight recorder: each rank's last events in a fixed ring, always on, readable after the rank is gone.

Why: `--trace` is written at the end, so a run that hangs or dies left nothing to look at,
and a `--timeout` could not say which rank was stuck in which collective. Every rank now
records its last CAPACITY events -- each collective (op, its sequence number on its group,
bytes, level, start, end or still open, failed), each micro-batch's compute, each blocked
wait, optimizer step, evaluation and checkpoint -- into a ring of fixed-size slots.

Cost: one event is one `struct.pack_into` into a slot picked by its event number; the ring
never grows and nothing is kept per event beyond its slot (bench/always_on.py measures it).

Where the ring lives: under lowcomm's own launcher (LOWCOMM_FLIGHT_DIR set) it is a file in
shared memory that the rank maps, so the launcher reads every rank's ring after a failure,
even a rank that was SIGKILLed or is SIGSTOPped and can write nothing itself
(diagnose/postmortem.py). Elsewhere (torchrun, tests) it is private memory that the rank
dumps itself when it fails.

Times are time.perf_counter() values: CLOCK_MONOTONIC on Linux, so one host's ranks and its
launcher share the clock.
"""
from __future__ import annotations

import itertools
import mmap
import os
import struct
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

CAPACITY = 4096  # events per rank: at ~10 events a step (ddp, tiny model), the last ~400 steps
ENV_DIR = "LOWCOMM_FLIGHT_DIR"  # set by the launcher: map the ring from a file in this directory
ENV_OFF = "LOWCOMM_FLIGHT"  # "off": no recorder; "alternate": on every other pair of steps (diagnose/flight_cost.py);
#                            bench/always_on.py's switch only, not a user setting

MAGIC = b"LCFLIGHT"
HEADER = struct.Struct("<8sqqq32x")  # magic, capacity, rank, pid; 64 bytes
# eid (1-based event number; 0: an empty slot), seq (a collective's number on its group),
# step, payload bytes, wire bytes, t0, t1 (0.0: still open), name, level, flags
SLOT = struct.Struct("<qqqqqddBBB5x")  # 64 bytes
_EID = struct.Struct("<q")
_T1 = struct.Struct("<d")
_T1_AT, _FLAGS_AT = 48, 58  # offsets of t1 and flags inside a slot

# "heal": an elastic run's state sent to the members behind (a broadcast; comm/objects.py)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier", "heal")
SPANS = ("micro-batch", "wait", "optimizer", "evaluate", "checkpoint")
NAMES = COLLECTIVES + SPANS
CODE = {name: i for i, name in enumerate(NAMES)}
LEVELS = ("cross", "intra", "world")
META, FAILED, OFF_MAIN = 1, 2, 4  # flags: a bookkeeping collective; it raised; on another thread than main


class Event(NamedTuple):
    eid: int
    seq: int
    step: int
    nbytes: int
    wire: int
    t0: float
    t1: float  # 0.0 while open
    name: str
    level: str
    flags: int

    @property
    def collective(self) -> bool:
        return self.name in COLLECTIVES

    @property
    def state(self) -> str:
        return "failed" if self.flags & FAILED else ("open" if self.t1 == 0.0 else "done")

    @property
    def meta(self) -> bool:
        return bool(self.flags & META)

    @property
    def main_thread(self) -> bool:
        return not self.flags & OFF_MAIN


class FlightRecorder:
    """One rank's ring. Thread-safe without a lock: event numbers come from an
    itertools.count (atomic under the GIL) and each event owns its slot."""

    def __init__(self, rank: int, capacity: int = CAPACITY, path: Path | str | None = None):
        self.rank, self.capacity, self.path = rank, capacity, path
        size = HEADER.size + capacity * SLOT.size
        if path is None:
            self._buf = bytearray(size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        HEADER.pack_into(self._buf, 0, MAGIC, capacity, rank, os.getpid())
        self._eids = itertools.count(1)
        self._main = threading.main_thread().ident
        self._local = threading.local()
        self.step = 0  # the trainer step in progress (the run driver sets it)
        self.paused = False  # the optimizer hooks record nothing (diagnose/flight_cost.py's off steps)
        # seconds of optimizer.step() on the main thread, summed: the per-step work a step log
        # splits out (the run driver takes each step's share); one on another thread runs
        # beside the main thread's work, so it costs the step nothing
        self.optimizer_s = 0.0

    @classmethod
    def for_rank(cls, rank: int) -> "FlightRecorder | None":
        """In the launcher's shared directory when there is one, else in private memory
        (None when the benchmark switched recording off)."""
        if os.environ.get(ENV_OFF) == "off":
            return None
        if os.environ.get(ENV_OFF) == "alternate":  # the benchmark's measurement inside one run
            from .flight_timed import TimedRecorder
            cls = TimedRecorder
        where = os.environ.get(ENV_DIR)
        return cls(rank, path=Path(where) / ring_name(rank) if where and os.path.isdir(where) else None)

    @property
    def shared(self) -> bool:
        return self.path is not None

    # -- recording -----------------------------------------------------------------------
    def open(self, code: int, t0: float, seq: int = 0, nbytes: int = 0, wire: int = 0, level: int = 0,
             meta: bool = False, t1: float = 0.0) -> int:
        """Record an event (open while t1 is 0.0); returns its number for `close`."""
        eid = next(self._eids)
        flags = meta | (0 if threading.get_ident() == self._main else OFF_MAIN)
        SLOT.pack_into(self._buf, HEADER.size + (eid % self.capacity) * SLOT.size,
                       eid, seq, self.step, nbytes, wire, t0, t1, code, level, flags)
        return eid

    def span(self, code: int, t0: float, t1: float) -> None:
        self.open(code, t0, t1=t1)

    def close(self, eid: int, t1: float, failed: bool = False) -> None:
        """End event `eid` at t1 (unless the ring has wrapped over it since)."""
        at = HEADER.size + (eid % self.capacity) * SLOT.size
        if _EID.unpack_from(self._buf, at)[0] != eid:
            return
        _T1.pack_into(self._buf, at + _T1_AT, t1)
        if failed:
            self._buf[at + _FLAGS_AT] |= FAILED

    def watch_optimizer(self, optimizer) -> None:
        """Record every optimizer.step() on the thread that ran it."""
        import time

        def pre(*_):
            t0 = time.perf_counter()
            self._local.opt_eid = None if self.paused else (self.open(CODE["optimizer"], t0), t0)

        def post(*_):
            opened = getattr(self._local, "opt_eid", None)
            if opened is not None:
                t1 = time.perf_counter()
                self.close(opened[0], t1)
                if threading.get_ident() == self._main:
                    self.optimizer_s += t1 - opened[1]
        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(post)

    # -- reading -------------------------------------------------------------------------
    def events(self) -> list[Event]:
        return parse(bytes(self._buf))[1]

    def release(self) -> None:
        """Unmap a shared ring (its file stays for the launcher to read)."""
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()


def ring_name(rank: int) -> str:
    return f"rank-{rank}.ring"


def level_code(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else 0


def parse(buf: bytes) -> tuple[dict, list[Event]]:
    """A ring's header and its events, oldest first."""
    magic, capacity, rank, pid = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ValueError("not a lowcomm flight ring")
    events = []
    for i in range(capacity):
        eid, seq, step, nbytes, wire, t0, t1, code, level, flags = SLOT.unpack_from(buf, HEADER.size + i * SLOT.size)
        if eid:
            events.append(Event(eid, seq, step, nbytes, wire, t0, t1, NAMES[code], LEVELS[level], flags))
    events.sort(key=lambda e: e.eid)
    return {"rank": rank, "pid": pid, "capacity": capacity}, events


def read_dir(where: Path | str) -> dict[int, list[Event]]:
    """Every rank's events from the rings in a launcher's directory, by rank."""
    rings = {}
    for path in sorted(Path(where).glob("rank-*.ring")):
        try:
            header, events = parse(path.read_bytes())
        except (OSError, ValueError, struct.error):  # a rank that died before its ring was whole
            continue
        rings[header["rank"]] = events
    return rings


@contextmanager
def recorded(flight: FlightRecorder | None, name: str):
    """An evaluation or checkpoint as one event: open while it runs, so a rank stuck in it shows there."""
    eid = 0 if flight is None else flight.open(CODE[name], time.perf_counter())
    yield
    if eid:
        flight.close(eid, time.perf_counter())

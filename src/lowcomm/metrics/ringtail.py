"""Reading a rank's flight ring (metrics/flight.py) while the rank writes it: each event once.

The launcher looks at every rank's ring five times a second while the run goes (metrics/stalls.py).
Parsing a whole ring each time (CAPACITY slots) would cost it milliseconds a look, on cores the
workers need; a tail unpacks each new event once and re-reads only the slots of the events it
saw open, to see them close. What it keeps is small and bounded: the open events, the last
collective of each level, the last event, recent step durations and recent durations of each
kind of collective -- what a stall is judged by.
"""
from __future__ import annotations

import mmap
import os
import statistics
from collections import deque
from pathlib import Path

from .flight import HEADER, LEVELS, MAGIC, NAMES, SLOT, Event

STEPS_KEPT = 16     # recent step durations: the run's own pace
DURATIONS_KEPT = 8  # recent durations of one kind of collective (level, name, bytes)
KINDS_KEPT = 256    # kinds of collective remembered (a run has a handful)


class RingTail:
    def __init__(self, buf):
        _magic, self.capacity, self.rank, self.pid = HEADER.unpack_from(buf, 0)
        self._buf = buf
        self._next = 1  # the next event number to read
        self.open: dict[int, Event] = {}        # eid -> an event not ended yet
        self.latest: dict[str, Event] = {}      # level -> the last collective issued on it
        self.last: Event | None = None
        self._step, self._step_t0 = 0, 0.0
        self.step_s: deque[float] = deque(maxlen=STEPS_KEPT)
        self._durations: dict[tuple, deque[float]] = {}

    @classmethod
    def of_file(cls, path: Path) -> "RingTail | None":
        """A tail of the ring in `path`; None while the rank has not written its header yet."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER.size:
                return None
            buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, capacity = HEADER.unpack_from(buf, 0)[:2]
        if magic != MAGIC or size < HEADER.size + capacity * SLOT.size:
            buf.close()
            return None
        return cls(buf)

    def poll(self) -> None:
        """Take in the events written since the last poll and the open ones that ended."""
        for eid, e in list(self.open.items()):
            now = self._slot(eid)
            if now is None or now.t1 != 0.0 or now.state == "failed":  # ended (or overwritten: gone)
                del self.open[eid]
                if now is not None:
                    self._ended(now)
        while True:
            e = self._slot(self._next, any_eid=True)
            if e is None or e.eid < self._next:  # not written yet
                return
            self._next = e.eid + 1  # e.eid > _next: the ring wrapped between two polls; go on from here
            self._take(e)

    def _take(self, e: Event) -> None:
        self.last = e
        if e.collective:
            self.latest[e.level] = e
        if e.main_thread and e.step != self._step:
            if self._step and e.step == self._step + 1:
                self.step_s.append(e.t0 - self._step_t0)
            self._step, self._step_t0 = e.step, e.t0
        if e.t1 == 0.0 and e.state != "failed":
            self.open[e.eid] = e
        else:
            self._ended(e)

    def _ended(self, e: Event) -> None:
        if not e.collective:
            return
        if self.latest.get(e.level) is not None and self.latest[e.level].eid == e.eid:
            self.latest[e.level] = e
        if e.state == "done":
            key = (e.level, e.name, e.nbytes)
            if key not in self._durations and len(self._durations) >= KINDS_KEPT:
                self._durations.clear()
            self._durations.setdefault(key, deque(maxlen=DURATIONS_KEPT)).append(e.t1 - e.t0)

    def _slot(self, eid: int, any_eid: bool = False) -> Event | None:
        eid_, seq, step, nbytes, wire, t0, t1, code, level, flags = \
            SLOT.unpack_from(self._buf, HEADER.size + (eid % self.capacity) * SLOT.size)
        if eid_ == 0 or (eid_ != eid and not any_eid) or code >= len(NAMES) or level >= len(LEVELS):
            return None  # empty, another event's, or caught half-written
        return Event(eid_, seq, step, nbytes, wire, t0, t1, NAMES[code], LEVELS[level], flags)

    # -- what the stall analysis asks ----------------------------------------------------
    def view(self) -> list[Event]:
        """The events a diagnosis needs (postmortem.diagnose): the open ones, the last collective
        of each level and the last event, oldest first."""
        kept = {e.eid: e for e in [*self.open.values(), *self.latest.values(), *([self.last] if self.last else [])]}
        return sorted(kept.values(), key=lambda e: e.eid)

    def in_span(self, *names: str) -> bool:
        """Whether the rank is inside one of these (open) spans, e.g. a checkpoint."""
        return any(e.name in names for e in self.open.values())

    def usual_s(self, op: Event) -> float | None:
        """The median duration of this rank's recent collectives of op's kind; None: none yet."""
        recent = self._durations.get((op.level, op.name, op.nbytes))
        return statistics.median(recent) if recent else None

    def close(self) -> None:
        self._buf.close()

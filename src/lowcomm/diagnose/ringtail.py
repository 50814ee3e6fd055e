"""Reading a rank's flight ring (comm/flight.py) while the rank writes it: each event once.

The launcher looks at every rank's ring five times a second while the run goes (diagnose/stalls.py).
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

from ..comm.flight import COLLECTIVES, HEADER, LEVELS, MAGIC, NAMES, OFF_MAIN, SLOT, Event

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
        self._last: tuple | None = None  # the last event, as unpacked
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
        # The hot loop of the launcher's watch: most events are spans already ended (a micro-batch,
        # a wait), of which only the step and time matter; they stay raw tuples, not Events.
        unpack, buf, cap, at = SLOT.unpack_from, self._buf, self.capacity, HEADER.size
        while True:
            raw = unpack(buf, at + (self._next % cap) * SLOT.size)
            if raw[0] < self._next or raw[7] >= len(NAMES) or raw[8] >= len(LEVELS):  # not written yet
                return
            self._next = raw[0] + 1  # above the one asked: the ring wrapped between two polls; go on from here
            self._last = raw
            if raw[2] != self._step and not raw[9] & OFF_MAIN:
                self._paced(raw[2], raw[5])
            if raw[7] < len(COLLECTIVES) or raw[6] == 0.0:
                self._take(Event(*raw[:7], NAMES[raw[7]], LEVELS[raw[8]], raw[9]))

    def _paced(self, step: int, t0: float) -> None:
        """A new step on the main thread: the last one's duration, when they follow each other."""
        if self._step and step == self._step + 1:
            self.step_s.append(t0 - self._step_t0)
        self._step, self._step_t0 = step, t0

    def _take(self, e: Event) -> None:
        if e.collective:
            self.latest[e.level] = e
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
        last = [] if self._last is None else [Event(*self._last[:7], NAMES[self._last[7]], LEVELS[self._last[8]],
                                                    self._last[9])]
        kept = {e.eid: e for e in [*self.open.values(), *self.latest.values(), *last]}
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

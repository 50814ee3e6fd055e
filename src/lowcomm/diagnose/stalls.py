"""Stalled collectives flagged while the run goes on: the launcher watches every rank's flight ring.

A collective one rank has waited in far longer than the run's steps take, because a peer has
not reached it (stopped, descheduled, stuck in I/O), stops the run only at --timeout (then the
flight recorder says who, diagnose/postmortem.py). A stall that resolves before that used to
leave no trace but a slow step. Now the launcher -- which rank 0 cannot be, as rank 0 is
often the one blocked -- looks at every rank's ring in shared memory at each of its polls
(every supervise.POLL_S), through tails that read each event once (diagnose/ringtail.py), and
applies the post-mortem's diagnosis to the live rings: the first collective some rank has not
completed, and the ranks that never reached it.

A stall is flagged when the waiting rank has been in the collective at least
max(STALL_MIN_S, STALL_STEPS x the run's median step) -- and, when every rank reached it (the
collective itself makes no progress), also STALL_RATIO x what that kind of collective usually
takes on that rank (an emulated slow link makes big ones long). A rank inside a checkpoint or an
evaluation is busy, not stalled; nothing is judged before the run has MIN_STEPS steps to pace
it, nor outside the training steps. When every rank is in the collective, a rank whose process
is stopped (SIGSTOP, a debugger: /proc says so) is the one named.

Seen: printed once as a line (unless --quiet), and written to the ring directory's stalls.jsonl
(updated at each poll while it lasts), from which rank 0 puts it in the `flags` of the step it
hit in steps.jsonl: `"stalled all_reduce #412 rank 1 3.2 s"` (the seconds: how long the first
rank to arrive had waited, at the launcher's last poll). Costs no worker anything but one
os.stat per log gather on rank 0; the launcher's poll reads only new events.
Needs lowcomm's launcher: under torchrun the rings are private to each rank.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from ..comm.flight import ENV_DIR, ring_name
from .postmortem import Stall, diagnose
from .ringtail import RingTail

STALL_MIN_S = 1.0   # never a stall below this: a busy machine deschedules a process for a moment
STALL_STEPS = 10.0  # and at least this many of the run's median steps
STALL_RATIO = 10.0  # every rank in it: this many times the usual duration of such a collective
MIN_STEPS = 3       # steps seen before anything is judged (the first steps warm up)
FILE = "stalls.jsonl"  # in the ring directory: the launcher writes, rank 0 reads
BUSY = ("checkpoint", "evaluate")


class StallWatch:
    """The launcher's side: `poll(processes)` at each turn of its watch loop."""

    def __init__(self, ring_dir: str | Path, world: int, quiet: bool = False):
        self.dir, self.world, self.quiet = Path(ring_dir), world, quiet
        self.tails: dict[int, RingTail] = {}
        self._current: tuple | None = None  # the stall being watched: (key, last flag written)
        self._who: tuple = ([], [])  # its culprits and waiting ranks, as first named
        self.broken = False

    def poll(self, processes=(), now: float | None = None) -> Stall | None:
        """Read the new events; flag a stall (or its end). Returns the stall flagged, if any.
        Best effort: whatever goes wrong in the watch ends the watch, never the run."""
        if self.broken:
            return None
        try:
            return self._poll(processes, now)
        except Exception as e:  # noqa: BLE001 -- a torn read, a vanished file: the run matters more
            self.broken = True
            print(f"lowcomm: warning: the stalled-collective watch stopped ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
            return None

    def _poll(self, processes, now: float | None) -> Stall | None:
        for rank in range(self.world):
            if rank not in self.tails:
                tail = RingTail.of_file(self.dir / ring_name(rank))
                if tail is None:
                    return None  # not every rank is up yet
                self.tails[rank] = tail
            self.tails[rank].poll()
        stall = self.find(time.perf_counter() if now is None else now, [p.pid for p in processes])
        if stall is not None:
            self._who = (stall.culprits, stall.waiting)
        self._report(stall)
        return stall

    def find(self, now: float, pids: list[int]) -> Stall | None:
        stall = diagnose({r: t.view() for r, t in self.tails.items()}, self.world, at=now)
        paces = [s for t in self.tails.values() for s in t.step_s]
        if stall is None or stall.op.step < 1 or len(paces) < MIN_STEPS:
            return None
        threshold = max(STALL_MIN_S, STALL_STEPS * statistics.median(paces))
        if not stall.culprits and self._current is not None and self._current[0] == _key(stall):
            # the stall seen before: its late rank stays named once it is in the collective too
            # (continued, it joins a moment before the collective completes)
            stall.culprits, stall.waiting = self._who
        if stall.culprits and all(self.tails[r].in_span(*BUSY) for r in stall.culprits):
            return None
        if not stall.culprits:
            stall.culprits = [r for r in stall.waiting if r < len(pids) and stopped(pids[r])]
            usual = self.tails[stall.waiting[0]].usual_s(stall.op)
            if not stall.culprits:
                if usual is None:  # nothing to compare with: --timeout is the judge
                    return None
                threshold = max(threshold, STALL_RATIO * usual)
            stall.waiting = [r for r in stall.waiting if r not in stall.culprits] or stall.waiting
        return stall if stall.waited_s >= threshold else None

    def _report(self, stall: Stall | None) -> None:
        if stall is None:
            if self._current is not None and not self.quiet:
                print(f"lowcomm: {self._current[1]} (resolved)", flush=True)
            self._current = None
            return
        key, flag = _key(stall), stall.flag()
        if (self._current is None or self._current[0] != key) and not self.quiet:
            print(f"lowcomm: step {stall.op.step}: {stall.line()}", flush=True)
        if self._current is None or self._current != (key, flag):
            try:
                with open(self.dir / FILE, "a") as f:  # one short line: rank 0 reads whole lines only
                    f.write(json.dumps({"key": key, "step": stall.op.step, "flag": flag}) + "\n")
            except OSError:  # a full /dev/shm: the live line stays, the run goes on
                pass
        self._current = (key, flag)

    def close(self) -> None:
        for tail in self.tails.values():
            tail.close()
        self.tails.clear()


def _key(stall: Stall) -> str:
    return f"{stall.op.level}:{stall.op.seq}"


def stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal or a tracer (Linux /proc; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] in (b"T", b"t")


class StallFlags:
    """Rank 0's side: the launcher's stall flags, put on the step records they belong to."""

    def __init__(self, ring_dir: str | Path):
        self.path = Path(ring_dir) / FILE
        self._read_to = 0
        self._pending: dict[str, dict] = {}  # key -> the latest entry, not on a record yet
        self._done: set[str] = set()

    @classmethod
    def for_run(cls) -> "StallFlags | None":
        where = os.environ.get(ENV_DIR)
        return cls(where) if where else None

    def flags(self, record: dict) -> list[str]:
        """The stalls that hit this record's step (or earlier steps, already written: named)."""
        self._read()
        step, found = record["step"], []
        for key, entry in list(self._pending.items()):
            if entry["step"] <= step:
                found.append(entry["flag"] + ("" if entry["step"] == step else f" (step {entry['step']})"))
                del self._pending[key]
                self._done.add(key)
        return found

    def _read(self) -> None:
        try:
            if os.stat(self.path).st_size == self._read_to:
                return
            with open(self.path, "rb") as f:
                f.seek(self._read_to)
                data = f.read()
        except OSError:
            return
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._read_to += len(whole)
        for line in whole.splitlines():
            entry = json.loads(line)
            if entry["key"] not in self._done:
                self._pending[entry["key"]] = entry

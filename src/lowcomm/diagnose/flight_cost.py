"""Bench-only: what the flight recorder costs, measured inside one run (bench/always_on.py).

Two runs' wall times differ by more than the recorder's cost on a shared machine (other jobs
come and go between them). So with LOWCOMM_FLIGHT=alternate (the benchmark's switch; not a
user setting) one run records on steps 1, 4, 5, 8, 9, ... and not on steps 2, 3, 6, 7, ...
(A B B A: a drift in load, or anything that alternates step by step, falls on both arms alike);
each step's `wall_s` in steps.jsonl then belongs to one arm, and both arms saw the same load.
Off means what LOWCOMM_FLIGHT=off means for the whole run: no recorder on any Comm or in the
run driver (the optimizer hooks stay registered and return at once: two calls a step).

And the recorder times its own calls (`open`, `close`; `span` is an `open`) on the steps it
records: each rank writes OUT/flight-cost-rank-N.json with the calls, their total and median
seconds (less the timer's own cost, measured), the steps recorded, and the bytes its ring would write as
flight/rank-N.json after a failure (postmortem.rank_record of what it holds).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..comm.flight_timed import TimedRecorder

ALTERNATE = "alternate"


def recording_on(step: int) -> bool:
    """A B B A: on for steps 1, 4, 5, 8, 9, ..."""
    return (step - 1) % 4 in (0, 3)


class AlternateRun:
    """The run, with the recorder attached on the steps `recording_on` picks and taken off the others."""

    def __init__(self, run, flight: TimedRecorder, comms: list, out: str, rank: int):
        self._run, self._flight, self._comms, self._out, self._rank = run, flight, comms, out, rank
        self._recorded = 0

    def __getattr__(self, name):
        return getattr(self._run, name)

    def step(self, next_batch, loss_fn):
        on = recording_on(self._run.steps_done + 1)
        self._recorded += on
        for c in self._comms:
            c.flight = self._flight if on else None
        self._flight.paused = not on
        return self._run.step(next_batch, loss_fn)

    def close(self):
        result = self._run.close()
        if self._out:
            self.write(Path(self._out))
        return result

    def write(self, out: Path) -> None:
        from .postmortem import failed_at, rank_record
        events = self._flight.events()
        dump = json.dumps(rank_record(self._rank, events, failed_at({self._rank: events}), "rank"), indent=2)
        (out / f"flight-cost-rank-{self._rank}.json").write_text(json.dumps(
            {**self._flight.spent(), "steps_recorded": self._recorded, "events_held": len(events),
             "steps_held": sorted({e.step for e in events}),
             "capacity": self._flight.capacity, "dump_bytes": len(dump) + 1}))


def alternate(run, flight, comms: list, out: str, rank: int):
    """`run`, or (with LOWCOMM_FLIGHT=alternate, when the recorder is a TimedRecorder) the run
    recording on alternate steps."""
    return AlternateRun(run, flight, comms, out, rank) if isinstance(flight, TimedRecorder) else run

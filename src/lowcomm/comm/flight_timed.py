"""A flight recorder that times its own calls (the benchmark's LOWCOMM_FLIGHT=alternate; what it
costs is reported by diagnose/flight_cost.py)."""
from __future__ import annotations

import statistics
import threading
import time

from .flight import FlightRecorder


class TimedRecorder(FlightRecorder):
    """A recorder that times each of its calls, per thread (gloo's threads close ops too)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._per_thread = threading.local()
        self._all: list[list[float]] = []

    def _times(self) -> list[float]:
        times = getattr(self._per_thread, "times", None)
        if times is None:
            times = self._per_thread.times = []
            self._all.append(times)
        return times

    def open(self, *args, **kwargs) -> int:
        t0 = time.perf_counter()
        eid = super().open(*args, **kwargs)
        self._times().append(time.perf_counter() - t0)
        return eid

    def close(self, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        super().close(*args, **kwargs)
        self._times().append(time.perf_counter() - t0)

    def spent(self) -> dict:
        """Calls; their total seconds (a call the OS descheduled counts whole) and their median,
        both less what the two timer reads around a call cost."""
        times = [t for per_thread in self._all for t in per_thread]
        timer = _timer_cost()
        return {"calls": len(times), "seconds": max(0.0, sum(times) - len(times) * timer),
                "median_s": max(0.0, statistics.median(times) - timer) if times else 0.0}


def _timer_cost(n: int = 20000) -> float:
    """Seconds two back-to-back perf_counter() reads add to a timed call (the least of a few tries)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            a = time.perf_counter()
            _ = time.perf_counter() - a
        best = min(best, (time.perf_counter() - t0) / n)
    return best

"""The device emulator beside the link emulator: a rank made to compute like a slower device.

A worker's compute is stretched by sleeping after it, so heterogeneous clusters (a
slower GPU, a straggling host) can be emulated on one machine; the sleep counts as
compute, since that is what a slower device would spend.
"""
from __future__ import annotations

import random
import time


class Pacer:
    """Makes this rank an emulated slower device: after compute that took c
    seconds it sleeps (f - 1) * c, f = its slowdown factor, times a straggler
    factor F on the steps where this rank is the straggler. Whether and which
    rank straggles is drawn from (seed, step) alone, so every rank agrees
    without communicating."""

    def __init__(self, rank: int, world: int, slowdown: float = 1.0,
                 straggler_prob: float = 0.0, straggler_factor: float = 1.0, seed: int = 0):
        self.rank, self.world, self.slowdown = rank, world, slowdown
        self.straggler_prob, self.straggler_factor, self.seed = straggler_prob, straggler_factor, seed
        self.slept_s = 0.0
        self._mark = time.perf_counter()

    def straggler(self, step: int) -> int | None:
        """The rank that straggles at `step`, or None."""
        if self.straggler_prob <= 0:
            return None
        rng = random.Random(self.seed * 1_000_003 + step)
        return rng.randrange(self.world) if rng.random() < self.straggler_prob else None

    def factor(self, step: int) -> float:
        f = self.slowdown
        return f * self.straggler_factor if self.straggler(step) == self.rank else f

    def start(self, t: float | None = None) -> None:
        self._mark = time.perf_counter() if t is None else t

    def pay(self, step: int, tracer=None) -> float:
        """Sleep for the compute since start() (or the last pay) at this step's factor."""
        now = time.perf_counter()
        extra = (self.factor(step) - 1.0) * (now - self._mark)
        if extra > 0:
            time.sleep(extra)
            end = time.perf_counter()
            self.slept_s += end - now
            if tracer is not None:
                tracer.span("slowdown", "compute.slowdown", now, end)
        self._mark = time.perf_counter()
        return max(extra, 0.0)

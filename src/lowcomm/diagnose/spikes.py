"""Loss-spike flags while the run goes: a step whose training loss jumps far above the recent ones.

A step's loss is one batch's, so it wanders, but a healthy run does not leap to several times
its recent level. When it does, an update overshot (a learning rate too high at the end of
the warm-up, an outer step too large) or the step's batch is unlike the rest; either way the
user should see it while the run goes, not find it in a plot. So a step is flagged when its
loss is at least RATIO times the median of the last WINDOW steps' losses and at least FLOOR
nats above it, after MIN_STEPS steps: `"loss spike 9.65 (x2.9 the median 3.33 of the last 10
steps)"` in the record's `flags`. A non-finite loss is a bad step (worker.check_steps), not a
spike; it does not enter the median either.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 10     # steps whose median is the recent level
MIN_STEPS = 5   # before this many finite losses there is no recent level to compare with
RATIO = 1.5     # this many times the recent level: a leap, not a hard batch
FLOOR = 0.5     # and at least this many nats above it (a loss near 0 doubles on noise alone)


class LossSpikeFlags:
    def __init__(self, window: int = WINDOW, ratio: float = RATIO, floor: float = FLOOR,
                 min_steps: int = MIN_STEPS):
        self.ratio, self.floor, self.min_steps = ratio, floor, min_steps
        self._recent: deque[float] = deque(maxlen=window)

    def flags(self, record: dict) -> list[str]:
        """This step record's loss-spike flag ([] for none)."""
        loss = record["loss"]
        if not math.isfinite(loss):
            return []
        found = []
        if len(self._recent) >= self.min_steps:
            level = statistics.median(self._recent)
            if loss >= self.ratio * level and loss - level >= self.floor:
                found.append(f"loss spike {loss:.2f} (x{loss / level:.1f} the median {level:.2f} of the last "
                             f"{len(self._recent)} steps)")
        self._recent.append(loss)
        return found


def is_spike(flag: str) -> bool:
    return flag.startswith("loss spike ")

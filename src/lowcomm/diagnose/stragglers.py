"""Straggler flags while the run goes: a rank whose compute is persistently above the others'.

Rank 0 sees every rank's compute time of each step (steps.jsonl's per_rank.compute_s). One slow
step is noise (a page fault, another job); a straggler is slow step after step. So each rank's
compute is taken as its median over the last WINDOW steps, and a rank whose median is at least
RATIO times the median of the others' medians is flagged on that step's record, with the ratio:
`"straggler rank 1 x3.0"` in the record's `flags` list (and on the progress line).
"""
from __future__ import annotations

import statistics
from collections import deque

WINDOW = 5    # steps: persistently slow, not one slow step
RATIO = 1.5   # above this many times the others' compute: a straggler


class StragglerFlags:
    def __init__(self, window: int = WINDOW, ratio: float = RATIO):
        self.ratio = ratio
        self._recent: deque[list[float]] = deque(maxlen=window)

    def flags(self, record: dict) -> list[str]:
        """The flags of this step record (added in place as `flags` when there are any)."""
        compute = record["per_rank"]["compute_s"]
        self._recent.append(compute)
        if len(compute) < 2 or len(self._recent) < self._recent.maxlen:
            return []
        medians = [statistics.median(step[r] for step in self._recent) for r in range(len(compute))]
        found = []
        for rank, mine in enumerate(medians):
            others = statistics.median(m for r, m in enumerate(medians) if r != rank)
            if others > 0 and mine >= self.ratio * others:
                found.append(f"straggler rank {rank} x{mine / others:.1f}")
        if found:
            record["flags"] = found
        return found

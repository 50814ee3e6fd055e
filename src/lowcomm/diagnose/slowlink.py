"""Slow-link flags while the run goes: a step whose communication waits are well above what the
emulated link model prices its collectives at.

Only with an emulated link (--link): the record then holds `link_model_s`, the seconds the
model gives this step's collectives (metrics/runlog.py). A healthy link makes a rank wait at
most about that long -- less when the ops overlap compute. But a rank also waits, inside the
collective, for a peer that arrives late, and that is a straggler (diagnose/stragglers.py), not
the link. The rank that waited least is the last to arrive: it waits for the link alone. So the
step's exposed time here is the least over ranks, and a step is flagged when it is at least RATIO
times the model's price and above it by at least FLOOR_S (a descheduled process on a busy machine
costs a few ms, which must not read as a slow link on a step the model prices at 1 ms):
`"slow link x2.4 (exposed 240 ms, link model 100 ms)"` in the record's `flags`.
"""
from __future__ import annotations

RATIO = 2.0     # this many times the link model's time: well above it, not jitter
FLOOR_S = 0.02  # and at least this many seconds above it


class SlowLinkFlags:
    def __init__(self, ratio: float = RATIO, floor_s: float = FLOOR_S):
        self.ratio, self.floor_s = ratio, floor_s

    def flags(self, record: dict) -> list[str]:
        """This step record's slow-link flag ([] for none, or for a run without an emulated link)."""
        model = record.get("link_model_s", 0.0)
        if not model > 0:
            return []
        exposed = min(record["per_rank"]["exposed_comm_s"])
        if exposed < self.ratio * model or exposed - model < self.floor_s:
            return []
        return [f"slow link x{exposed / model:.1f} (exposed {ms(exposed)}, link model {ms(model)})"]


def ms(seconds: float) -> str:
    """Seconds as milliseconds a reader compares at a glance (a decimal only below 10 ms)."""
    return f"{1000 * seconds:.0f} ms" if seconds >= 0.0095 else f"{1000 * seconds:.1f} ms"

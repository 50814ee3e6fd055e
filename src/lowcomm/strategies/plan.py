"""A strategy's declared communication plan: what one rank sends, and how often.

Each strategy answers `comm_plan(num_params, world, options)` with a list of
PlannedOp. The contract tests check it against the bytes Comm counts, and the
planner prices it with LinkModel's formulas (comm/wire.py), so the strategy's
traffic has one source of truth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..comm.wire import wire_bytes


@dataclass(frozen=True)
class PlannedOp:
    collective: str  # all_reduce, reduce_scatter, all_gather, broadcast, all_to_all
    nbytes: int      # S as Comm counts it (comm/wire.py): the logical payload of one op
    every: int = 1   # runs at trainer steps t = offset + every * k (t counted from 1)
    offset: int = 0  # 0 means t = every, 2*every, ...
    what: str = ""   # what it carries, for reports

    def wire_bytes(self, world: int) -> int:
        """Ring-model bytes one rank sends for one occurrence."""
        return wire_bytes(self.collective, self.nbytes, world)

    def occurrences(self, steps: int) -> int:
        """Occurrences in trainer steps 1..steps."""
        first = self.offset if self.offset > 0 else self.every
        return 0 if steps < first else (steps - first) // self.every + 1


def bytes_per_step(plan: list[PlannedOp], world: int) -> float:
    """Steady-state ring bytes one rank sends per trainer step."""
    return sum(op.wire_bytes(world) / op.every for op in plan)


def flat_numel(num_params: int, world: int) -> int:
    """The flat buffer of sharded strategies: num_params padded to a multiple of world."""
    return -(-num_params // world) * world


@dataclass(frozen=True)
class StepCost:
    """What `lowcomm plan` (planner.py) tells a strategy about one trainer step when it
    asks how much of its communication is exposed (Strategy.exposed_comm_s)."""
    price: Callable[[str, int], float]  # modeled seconds of one collective of S bytes: LinkModel.duration
    compute_s: float                    # one step's compute on the slowest worker
    accum: int = 1                      # micro-batches per step
    steps: int | None = None            # a run of this many trainer steps; None: the steady state
    worker_compute_s: tuple = ()        # each worker's compute of `accum` micro-batches (slowdowns in)

"""A strategy's declared communication plan: what one rank sends, and how often.

Each strategy answers `comm_plan(layout, world, options)` (layout: the model's
`ModelLayout`, models/layout.py) with a list of PlannedOp. The contract tests check
it against the bytes Comm counts, and the planner prices it with LinkModel's
formulas (comm/wire.py), so the strategy's traffic has one source of truth.
`Cost` is the price of an engine whose collectives start after the compute: the default cost
model a strategy names (`Strategy.cost`), the base of the engines' own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from ..comm.wire import wire_bytes
from .options import Options


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


ONCE = 2**62  # PlannedOp.every of an op that runs once in a run (with offset=1: at its first step)


def bytes_per_step(plan: list[PlannedOp], world: int) -> float:
    """Steady-state ring bytes one rank sends per trainer step."""
    return sum(op.wire_bytes(world) / op.every for op in plan)


def flat_numel(num_params: int, world: int) -> int:
    """The flat buffer of sharded strategies: num_params padded to a multiple of world."""
    return -(-num_params // world) * world


@dataclass(frozen=True)
class LevelPlans:
    """A run of replica groups: what one rank sends inside its replica (every rank alike) and
    across replicas (one plan per position p of a replica: the ranks at p hold their own part)."""
    intra: list[PlannedOp]
    cross: list[list[PlannedOp]]

    def cross_bytes_per_step(self, replicas: int) -> float:
        """Steady-state ring bytes all ranks together send across replicas per trainer step
        (each occurrence at its `every`; a strategy's transients left out)."""
        return replicas * sum(bytes_per_step(plan, replicas) for plan in self.cross)

    def slowest_cross(self, replicas: int) -> list[PlannedOp]:
        """The position whose cross-replica plan sends the most (the one a step waits for)."""
        return max(self.cross, key=lambda plan: bytes_per_step(plan, replicas))


def owned_tensors_plan(layout, size: int) -> list[PlannedOp]:
    """Inside a replica of `size` ranks that own whole tensors: the fp32 gradients reduce-
    scattered to their owners and the owners' fp32 parameters all-gathered, each position's
    part padded to the largest (one collective each per trainer step)."""
    numels = layout.numels
    part = max(sum(numels[j] for j in owned) for owned in layout.positions(size))
    return [PlannedOp("reduce_scatter", 4 * size * part, what="gradients to their owners inside the replica (fp32)"),
            PlannedOp("all_gather", 4 * size * part, what="the owners' parameters inside the replica (fp32)")]


@dataclass(frozen=True)
class StepCost:
    """What `lowcomm plan` (plan/planner.py) tells a cost model about one trainer step when it
    asks how much of a plan's communication is exposed (Cost.exposed_comm_s)."""
    price: Callable[[str, int], float]  # modeled seconds of one collective of S bytes: LinkModel.duration
    compute_s: float                    # one step's compute on the slowest worker
    accum: int = 1                      # micro-batches per step
    steps: int | None = None            # a run of this many trainer steps; None: the steady state
    worker_compute_s: tuple = ()        # each worker's compute of `accum` micro-batches (slowdowns in;
                                        # one entry where every worker is alike)


# A steady-state horizon in trainer steps, divisible by every usual period (powers of two, 10^k,
# 500): plan_rate counts occurrences between STEADY and 2*STEADY, past any transient.
STEADY = 2**12 * 10**6


class Cost:
    """The price of an engine whose collectives start after the step's compute (zero1, diloco's
    outer step without a delay, the compressed all-reduces): what `lowcomm plan` (plan/planner.py),
    a run's level report (metrics/levels.py) and the contract tests ask about a strategy's plan,
    besides the plan itself (Strategy.comm_plan). A strategy names its engine's cost model in a
    line (`cost = BucketedAllReduce`); a model for another engine overrides what its schedule
    changes (ddp's buckets, acco's overlapped rounds, the outer sync's delay: engines/costs.py,
    engines/costs_sharded.py, engines/outer_contract.py). Never instantiated: class methods only.

    It lives here because every strategy's default is this one and the contract imports no
    engine; the engines' models live beside their engines, which strategies may import and
    plan/ may call, while the library never imports plan/ (it imports train/ for the model)."""

    # Share of one step's compute that the collectives run behind: 0 means they start after the
    # compute and are exposed in full; 1 means a whole step of compute can hide them (acco, dpu).
    comm_overlap: ClassVar[float] = 0.0

    @classmethod
    def defence_work(cls, options: Options, world: int, numel: int, seq_len: int):
        """What a defence against untrusted workers (--aggregate, --score) costs a worker beyond
        the wire, at each of its syncs (robust/costs.py's DefenceWork), or None: no defence."""
        return None

    @classmethod
    def plan_label(cls, strategy, options: Options) -> str:
        """The strategy as a plan's table names it, with the option that sets how often it
        talks where it has one (e.g. 'diloco H=64')."""
        return strategy.name

    @classmethod
    def plan_occurrences(cls, op: PlannedOp, steps: int, options: Options) -> int:
        """How often `op` runs in a run of `steps` trainer steps (transients included)."""
        return op.occurrences(steps)

    @classmethod
    def intra_occurrences(cls, op: PlannedOp, steps: int, options: Options) -> int:
        """How often `op` of the plan inside a replica runs in `steps` trainer steps (default: as
        its cadence says; an engine whose rounds skip a step says which of these go with them)."""
        return op.occurrences(steps)

    @classmethod
    def plan_rate(cls, op: PlannedOp, options: Options, steps: int | None = None) -> float:
        """How often `op` runs per trainer step: averaged over a run of `steps` steps, or in
        the steady state (transients such as warm-up steps or a final sync left out)."""
        if steps is not None:
            return cls.plan_occurrences(op, steps, options) / steps
        return (cls.plan_occurrences(op, 2 * STEADY, options) - cls.plan_occurrences(op, STEADY, options)) / STEADY

    @classmethod
    def exposed_comm_s(cls, plan: list[PlannedOp], cost: StepCost, options: Options) -> float:
        """Modeled seconds per trainer step that a worker waits on the network."""
        comm = sum(cost.price(op.collective, op.nbytes) * cls.plan_rate(op, options, cost.steps) for op in plan)
        return max(0.0, comm - cls.comm_overlap * cost.compute_s)

    @classmethod
    def micro_batches_per_step(cls, cost: StepCost, comm_s: float, options: Options) -> float:
        """Micro-batches a worker computes per trainer step, averaged over the workers:
        `accum`, except where an engine computes more while it waits (adaptive acco)."""
        return float(cost.accum)

    @classmethod
    def level_plans(cls, strategy, layout, replicas: int, size: int, options: Options) -> LevelPlans:
        """What one rank of `strategy` sends at each level with `replicas` replicas of `size`
        ranks. Here (engines/inside.py): position p of a replica owns whole tensors
        (layout.positions); inside, the gradients are reduce-scattered to their owners and the
        owners' updated parameters all-gathered, every step; across, position p runs the
        strategy's own plan on its tensors, on `replicas` ranks."""
        return LevelPlans(owned_tensors_plan(layout, size), [strategy.comm_plan(layout.subset(owned), replicas, options)
                                                             for owned in layout.positions(size)])

    @classmethod
    def fsdp_intra_extra(cls, one_micro_batch, options: Options) -> list[PlannedOp]:
        """What one rank sends inside its replica with fsdp inside beyond FSDP's own collectives
        for the step's micro-batches (`one_micro_batch()`: those of one micro-batch, as PlannedOps);
        here nothing."""
        return []

    @classmethod
    def model_state_bytes(cls, num_params: int, world: int, options: Options) -> int:
        """Bytes per worker of parameters, gradients and optimizer state (activations not
        included). Here: fp32 θ and ∇θ and AdamW's two moments, replicated on every worker."""
        return 16 * num_params

    @classmethod
    def fsdp_copy_bytes(cls, shard_params: int, replicas: int, options: Options) -> int:
        """Bytes a rank holds with fsdp inside beyond its 1/K of model_state_bytes, for a shard of
        `shard_params` values (the planner's memory column); here none."""
        return 0

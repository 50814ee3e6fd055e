"""What one rank sends at each level of a planned cluster, and what a collective costs there.

A flat cluster (R = W replicas of one process) has one level, "cross": the strategy's own
comm_plan on the W workers over --link. With replica groups (R replicas of K = W/R ranks,
engines/inside.py) the strategy's cost model's `level_plans` says what a rank sends inside its
replica (on K ranks, over --intra-link) and across replicas (one plan per position of a
replica, on R ranks, over --link). A step waits for the position that sends the most
(LevelPlans.slowest_cross); the bytes a cluster sends add up every position's plan.
These are the same plans metrics/levels.py sets beside a run's counted bytes.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..comm.link import LinkModel
from ..errors import UsageError
from ..contract.options import Options
from ..contract.plan import PlannedOp
from ..engines.inside import inside_level_plans


@dataclass(frozen=True)
class Level:
    """One level of a cluster: the groups a rank talks in there and what they send."""
    name: str                       # "intra" (inside a replica) or "cross" (across replicas)
    plans: list[list[PlannedOp]]    # one plan per position of a replica (inside: one for all)
    ranks: int                      # ranks in each group of this level
    groups: int                     # groups side by side (each sends its plan at the same time)
    link: LinkModel | None          # None: unshaped, its collectives cost no time

    def price(self, collective: str, nbytes: int) -> float:
        """Modeled seconds of one collective of `nbytes` on this level (LinkModel.duration)."""
        return self.link.duration(collective, nbytes, self.ranks) if self.link is not None else 0.0

    def slowest(self, rate) -> list[PlannedOp]:
        """The plan that sends the most per step (`rate(op)`: its occurrences per step); the one a step waits for."""
        return max(self._distinct(), key=lambda plan: self._bytes(plan, rate))

    def wire_bytes_per_rank(self, rate) -> float:
        """Ring bytes one rank sends here per step, averaged over the positions of a replica:
        times W, every rank's bytes at this level."""
        counts = Counter(id(plan) for plan in self.plans)
        return sum(self._bytes(plan, rate) * counts[id(plan)] for plan in self._distinct()) / len(self.plans)

    def _bytes(self, plan: list[PlannedOp], rate) -> float:
        return sum(op.wire_bytes(self.ranks) * rate(op) for op in plan)

    def _distinct(self) -> list[list[PlannedOp]]:
        """The plans, each list once: ddp gives its K positions one list (K may be a million)."""
        return list({id(plan): plan for plan in self.plans}.values())

    def comm_s(self, plan: list[PlannedOp], rate) -> float:
        """Seconds per step `plan`'s collectives are in flight on this level."""
        return sum(self.price(op.collective, op.nbytes) * rate(op) for op in plan)


def cluster_levels(cls, layout, workers: int, replicas: int, options: Options, link: LinkModel | None,
                   intra_link: LinkModel | None, inside: str = "ddp", accum: int = 1) -> tuple[Level, Level]:
    """(inside, across) for strategy class `cls` on `workers` ranks as `replicas` replicas,
    engine `inside` in each (fsdp's traffic grows with the `accum` micro-batches of a step)."""
    size = workers // replicas
    if size == 1:  # flat: the strategy's own plan on the world, nothing inside
        return (Level("intra", [[]], 1, workers, None),
                Level("cross", [cls.comm_plan(layout, workers, options)], workers, 1, link))
    check_fits(cls, layout, size)
    plans = inside_level_plans(inside, cls, layout, replicas, size, options, accum)
    return (Level("intra", [plans.intra], size, replicas, intra_link),
            Level("cross", plans.cross, replicas, size, link))


def check_fits(cls, layout, size: int) -> None:
    """A strategy that runs on the whole tensors each position owns needs a tensor for every
    rank of a replica (the run refuses the same at start-up: contract/base.py)."""
    if cls.owns_tensors and size > len(layout.shapes):
        raise UsageError(f"strategy '{cls.name}': a replica of {size} ranks has more ranks than the model has "
                         f"tensors ({len(layout.shapes)}): each rank must own one; use fewer ranks per replica")


def fits(cls, layout, size: int) -> bool:
    return not (cls.owns_tensors and size > len(layout.shapes))


def inside_rate(steps: int | None):
    """Occurrences per step of an op inside a replica: the engine's collectives run on their own
    schedule, not the strategy's (metrics/levels.py counts them by op.occurrences too)."""
    return lambda op: op.occurrences(steps) / steps if steps is not None else 1 / op.every


def replica_state_bytes(cls, layout, workers: int, replicas: int, options: Options, inside: str = "ddp") -> int:
    """Bytes per rank of parameters, gradients and optimizer state. Flat: the strategy's own
    count. With replica groups, a strategy that owns whole tensors holds its state for the
    largest position's part only (on R ranks), plus fp32 θ and ∇θ of the rest of the replica's
    tensors (every rank holds the whole model and computes every gradient); ddp splits no
    state: its own count. fsdp inside: every rank holds 1/K of every tensor and of its state
    (the units gathered for a forward or backward are transient, not counted), and what the
    strategy keeps beside FSDP's shards (the zero1 family: a copy of them, cls.cost.fsdp_copy_bytes)."""
    size = workers // replicas
    if size > 1 and inside == "fsdp":
        shard = -(-layout.numel // size)
        return -(-cls.cost.model_state_bytes(layout.numel, replicas, options) // size) + \
            cls.cost.fsdp_copy_bytes(shard, replicas, options)
    if size == 1 or not cls.owns_tensors:
        return cls.cost.model_state_bytes(layout.numel, workers if size == 1 else replicas, options)
    numels = layout.numels
    part = max(sum(numels[j] for j in owned) for owned in layout.positions(size))
    return cls.cost.model_state_bytes(part, replicas, options) + 8 * (layout.numel - part)


def divisors(n: int) -> list[int]:
    """Every R dividing n, largest first (R = n, the flat cluster, first)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small}, reverse=True)

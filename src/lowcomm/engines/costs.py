"""What the planner prices by engine: the all-reduce engines' cost models (contract/plan.py's
`Cost` says what a cost model answers). A strategy names its model in a line (`cost = ...`);
`lowcomm plan` (plan/planner.py), a run's level report (metrics/levels.py) and the contract
tests call it.

Why here: a strategy's file may import engines/, and plan/ may call them, while the library
never imports plan/ (plan/ imports train/ for the model a run would build) -- and a run's own
report needs the same occurrences and level plans the planner prices. The sharded engines'
models (zero1, overlapped rounds) are in costs_sharded.py, the outer sync's in outer_contract.py.

    BucketedAllReduce   ddp: torch's buckets all-reduced behind the last micro-batch's backward
    CompressedAllReduce quantized: the compressed all-reduce after the step, split by position
    OneBitAdamCost      onebit_adam: the same, an exact fp32 warm-up first
    PowerSGDCost        powersgd: plain all-reduces until `start`, then P and Q, all exposed
    DeMoCost            demo: one all-gather after the step, no AdamW state
"""
from __future__ import annotations

import torch.distributed as dist

from .compressed import residual_bytes, shard_len, split_piece
from ..contract.plan import Cost, LevelPlans, PlannedOp, flat_numel
from ..models.layout import ModelLayout
from ..robust.costs import defence_work


def bucket_runs(nbytes: int, first: int, size: int) -> list[tuple[int, int]]:
    """DDP's buckets of `nbytes` as runs of equal buckets, [(bytes, count)]: torch's first
    bucket of `first` bytes, then `size`-byte ones, the last one short."""
    head = min(nbytes, first)
    full, tail = divmod(nbytes - head, size)
    return [(b, n) for b, n in ((head, 1), (size, full), (tail, 1)) if b > 0 and n > 0]


def last_bucket_sent(runs: list[tuple[int, int]], total: int, backward: float, price) -> float:
    """When one NIC, sending the buckets in turn as each fills (their bytes arriving evenly over
    `backward` seconds), is done with the last: nic_j = max(arrival_j, nic_j-1) + price(j)
    unrolled is the latest, over buckets j, of j's arrival plus the price of j and of every
    bucket after it. Within a run of equal buckets both terms are linear in j, so the run's
    first or last bucket gives its latest: O(runs), where a loop over the buckets took 1.6
    million turns for a 1e13-parameter model."""
    latest, after, done = 0.0, 0.0, total
    for size, count in reversed(runs):  # `done`: bytes filled once the run's last bucket is
        each = price(size)
        latest = max(latest, backward * done / total + each + after,
                     backward * (done - (count - 1) * size) / total + count * each + after)
        after += count * each
        done -= count * size
    return latest


class BucketedAllReduce(Cost):
    """torch's DDP: the fp32 gradients all-reduced bucket by bucket as the last micro-batch's
    backward fills them; across replica groups HSDP's split (ddp.py's replica_hook). The plan
    lists one all-reduce of every gradient: each bucket's ring count is rounded down on its own,
    so at W=3 Comm can count a few bytes less."""

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        # DDP all-reduces a bucket as soon as the last micro-batch's backward (2/3 of
        # its 6·N·tokens FLOPs) has filled it: torch's first bucket holds 1 MiB, the others
        # bucket_mb. Gradients are taken to arrive evenly over the backward; one NIC
        # sends the buckets in turn, and what is left when the backward ends is exposed.
        backward = cost.compute_s / cost.accum * 2 / 3
        exposed = 0.0
        for op in plan:
            runs = bucket_runs(op.nbytes, dist._DEFAULT_FIRST_BUCKET_BYTES, int(options.bucket_mb * 2**20))
            nic_free = last_bucket_sent(runs, op.nbytes, backward, lambda size: cost.price(op.collective, size))
            exposed += max(0.0, nic_free - backward) * cls.plan_rate(op, options, cost.steps)
        return exposed

    @classmethod
    def level_plans(cls, strategy, layout, replicas, size, options):
        # HSDP's split: inside, the gradients reduce-scattered and the pieces all-gathered
        # (padded to a multiple of K, as one bucket is: several buckets pad each on its own);
        # across, each position all-reduces its 1/K.
        padded = 4 * flat_numel(layout.numel, size)
        cross = [PlannedOp("all_reduce", padded // size, what="this position's 1/K of the gradients (fp32)")]
        return LevelPlans([PlannedOp("reduce_scatter", padded, what="gradients inside the replica (fp32, in buckets)"),
                           PlannedOp("all_gather", padded, what="the reduced pieces inside the replica (fp32)")],
                          [cross] * size)


class CompressedAllReduce(Cost):
    """compressed.py's all-reduce after the step (quantized): error-feedback residuals beside
    a replicated AdamW; across replica groups each position's piece (SplitByPosition)."""

    reduced_inside = False  # inside a replica: each position's piece reduce-scattered (True: all-reduced whole)

    @classmethod
    def level_plans(cls, strategy, layout, replicas, size, options):
        """Inside, each position's piece reduced to its mean (a reduce-scatter; `reduced_inside`:
        the whole vector all-reduced first) and the pieces' means all-gathered, fp32; across,
        the strategy's own plan on a piece."""
        block = options.block_size
        piece = split_piece(layout.numel, replicas, size, block)
        reduce = (PlannedOp("all_reduce", 4 * replicas * shard_len(layout.numel, replicas, block),
                            what="the whole vector's mean inside the replica (fp32)") if cls.reduced_inside else
                  PlannedOp("reduce_scatter", 4 * size * piece,
                            what="each position's piece, its mean inside the replica (fp32)"))
        gather = PlannedOp("all_gather", 4 * size * piece, what="the pieces' means inside the replica (fp32)")
        return LevelPlans([reduce, gather], [strategy.comm_plan(ModelLayout(((piece,),)), replicas, options)] * size)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # replicated AdamW, plus the error-feedback residuals
        return 16 * num_params + cls.residuals(num_params, world, options)

    @staticmethod
    def residuals(num_params: int, world: int, options) -> int:
        return residual_bytes(num_params, world, options.block_size) if options.error_feedback else 0


class OneBitAdamCost(CompressedAllReduce):
    """1-bit Adam: the fp32 all-reduce in the warm-up steps, the compressed pair after."""

    reduced_inside = True

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        warm = min(steps, options.warmup_steps(steps))
        return warm if op.collective == "all_reduce" else steps - warm

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # replicated AdamW and the frozen denominators, plus the error-feedback residuals
        return 20 * num_params + cls.residuals(num_params, world, options)


class PowerSGDCost(Cost):
    """torch's PowerSGD hook: plain all-reduces for the first `start` steps, then P and Q. It
    compresses a bucket, then all-reduces P and Q in turn: with few buckets little of it overlaps
    the backward, so all of it counts as exposed; across replica groups the owned tensors' plans."""

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        if op.offset == 0:
            return min(steps, options.start)
        return op.occurrences(steps)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return 20 * num_params  # DDP's, plus torch's error-feedback copy of the gradients


class DeMoCost(Cost):
    """DeMo: one all-gather of the top-k after the step."""

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return 12 * num_params  # θ, ∇θ and the momentum δ (fp32); no AdamW state

    @classmethod
    def defence_work(cls, options, world, numel, seq_len):
        # a robust --aggregate decodes every sender's payload alone, each step (robust/gathered.py);
        # --score's forwards run every --score-every steps (engines/step_scoring.py): spread over them
        scored = options.score_batches / options.score_every if options.score else 0
        return defence_work(options.aggregator(), options.score, world, numel, scored, seq_len, 1.0)

    @classmethod
    def plan_label(cls, strategy, options):
        aggregator = options.aggregator()
        return f"{strategy.name} {aggregator.spec}" if aggregator.robust else strategy.name

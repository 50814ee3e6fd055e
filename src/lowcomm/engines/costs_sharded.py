"""What the planner prices by engine: the sharded engines' cost models (flat.py's ZeRO-1 layout,
overlap.py's rounds beside compute). contract/plan.py's `Cost` says what a cost model answers and
costs.py why the models live in engines/.

    ShardedCost     zero1: reduce-scatter and all-gather after the step; 1/W of the optimizer state
    OverlappedCost  a round's traffic behind the next micro-batches' compute; its votes inside a replica
    AccoCost        acco: two rounds a step, adaptive rounds, the start-up micro-batch
    DpuCost         dpu: synchronous warm-up steps, then one round a step but the first delayed one
"""
from __future__ import annotations

from dataclasses import replace

from ..contract.plan import ONCE, Cost, LevelPlans, flat_numel
from .flat import flat_bytes
from .overlap import VOTES


def two_rounds(round_plan):
    """A step's traffic: the round's, once for the estimate round and once for the real one."""
    return [replace(op, what=f"{op.what}, {which} round") for which in ("estimate", "real") for op in round_plan]


def at_startup(plan):
    """`plan`'s ops once, at the run's first step (acco's start-up micro-batch)."""
    return [replace(op, every=ONCE, offset=1, what=f"{op.what}, at start-up") for op in plan]


class ShardedCost(Cost):
    """ZeRO-1's flat buffers (flat.py): the collectives start after the step's compute."""

    separate_master = False  # the strategy's own: its fp32 master kept apart from fp32 parameters

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # flat θ and ∇θ in parameter precision; the fp32 master shard (unless it aliases
        # fp32 parameters) and AdamW's two moments of the own shard
        n, flat = flat_numel(num_params, world), flat_bytes(num_params, world, options)
        aliased = flat == 4 * n and not cls.separate_master
        return 2 * flat + (0 if aliased else 4 * n // world) + 8 * n // world

    @classmethod
    def fsdp_copy_bytes(cls, shard_params, replicas, options):
        return 2 * flat_bytes(shard_params, replicas, options)  # flat θ and ∇θ: copies of FSDP's shards


class OverlappedCost(ShardedCost):
    """overlap.py's rounds (OverlappedStrategy): a round's communication runs behind the next
    micro-batches' compute; its votes are summed inside a replica, whichever engine runs there.
    Beside ZeRO-1's state, the round buffer B."""

    separate_master = True
    comm_overlap = 1.0

    @classmethod
    def level_plans(cls, strategy, layout, replicas, size, options):
        plans = super().level_plans(strategy, layout, replicas, size, options)
        return LevelPlans(plans.intra + [VOTES], plans.cross)

    @classmethod
    def fsdp_intra_extra(cls, one_micro_batch, options):
        return [VOTES]

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return super().model_state_bytes(num_params, world, options) + flat_bytes(num_params, world, options)


class AccoCost(OverlappedCost):
    """ACCO: an estimate and a real round a step, each computing half the step's batch; rounds
    keep computing while they wait (but deterministic ones); one micro-batch at start-up."""

    @classmethod
    def micro_batches_per_step(cls, cost, comm_s, options):
        """A round lasts as long as the slowest worker's `accum` half micro-batches or the
        previous round's communication, whichever is longer; every worker keeps computing
        meanwhile, up to max_accum (deterministic: exactly accum). In full micro-batches a step
        (two rounds of halves) computes what one round computes in halves, so the ratio of a
        round's time to a step's compute is the same as it was per round. The planner counts
        the extra tokens."""
        accum = cost.accum
        if options.deterministic or not cost.worker_compute_s:
            return float(accum)
        bound = options.rounds_bound(accum)
        round_s = max(max(cost.worker_compute_s), comm_s)
        per_worker = [min(bound, max(accum, round_s * accum / c)) if c > 0 else bound for c in cost.worker_compute_s]
        return sum(per_worker) / len(per_worker)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # overlapped rounds' (B), plus the estimate round's snapshot of the master shard and its
        # AdamW moments (acco's extra_memory_bytes measures the same)
        return super().model_state_bytes(num_params, world, options) + 12 * flat_numel(num_params, world) // world

    @classmethod
    def level_plans(cls, strategy, layout, replicas, size, options):
        # Inside the replica, both rounds reduce the owners' gradients, share their parameters
        # and count; the start-up micro-batch's gradients are reduced once more (the count goes
        # with the first round). Across, each position's plan is comm_plan's: two rounds.
        plans = super().level_plans(strategy, layout, replicas, size, options)
        startup = at_startup([op for op in plans.intra if op.collective == "reduce_scatter"])
        return LevelPlans(two_rounds(plans.intra) + startup, plans.cross)

    @classmethod
    def fsdp_intra_extra(cls, one_micro_batch, options):
        # With fsdp inside: each round's votes, and FSDP's collectives for the start-up micro-batch
        # (the step's two rounds of halves are FSDP's plan at micro_batch_parts · accum).
        return two_rounds(super().fsdp_intra_extra(one_micro_batch, options)) + at_startup(one_micro_batch())


class DpuCost(OverlappedCost):
    """DPU: the first warmup_steps steps synchronous ZeRO-1 steps (exposed in full), then a round
    a step behind the next step's compute, but the first delayed step, which sends nothing."""

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        # A round every step, except the first delayed one (its gradient is applied a step later).
        return steps - 1 if steps > options.warmup_steps else steps

    @classmethod
    def intra_occurrences(cls, op, steps, options):
        # The votes inside a replica go with the rounds; the gradient sum inside it runs every step.
        return cls.plan_occurrences(op, steps, options) if op == VOTES else op.occurrences(steps)

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        synchronous = 0.0 if cost.steps is None else min(options.warmup_steps, cost.steps) / cost.steps
        comm = sum(cost.price(op.collective, op.nbytes) * cls.plan_rate(op, options, cost.steps) for op in plan)
        return synchronous * comm + (1 - synchronous) * max(0.0, comm - cost.compute_s)

"""DPU -- delayed parameter update (ACCO's ablation baseline).

    θ_{t+1} = opt(θ_t; g(θ_{t-1}))

The round that reduces g(θ_{t-1}) and steps the shard runs on the
communication thread while g(θ_t) is computed, so communication hides behind
compute, at the price of a one-step-stale gradient. The first `warmup_steps`
steps are synchronous ZeRO-1 steps; the first delayed step only computes the
gradient that the next one applies (it sends nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engines.flat import ShardedOptions
from ..contract.options import option
from ..engines.overlap import OverlappedStrategy
from .registry import register


@dataclass
class DpuOptions(ShardedOptions):
    warmup_steps: int = option(10, "synchronous ZeRO-1 steps before updates become delayed",
                               flag="--dpu-warmup", min=0)


@register("dpu")
class DPU(OverlappedStrategy):
    Options = DpuOptions
    inside_replica = ("ddp",)  # across replica groups: on the tensors each position owns

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.warmup_steps = self.options.warmup_steps
        self.updates = 0

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        # A round every step, except the first delayed one (its gradient is applied a step later).
        return steps - 1 if steps > options.warmup_steps else steps

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        # The first warmup_steps steps are synchronous (exposed in full); then overlapped.
        synchronous = 0.0 if cost.steps is None else min(options.warmup_steps, cost.steps) / cost.steps
        comm = sum(cost.price(op.collective, op.nbytes) * cls.plan_rate(op, options, cost.steps) for op in plan)
        return synchronous * comm + (1 - synchronous) * max(0.0, comm - cost.compute_s)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # ZeRO-1's plus the round buffer B
        return super().model_state_bytes(num_params, world, options) + cls.flat_bytes(num_params, world, options)

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(self.updates)
        self.synchronous = self.steps_done < self.warmup_steps
        self.delayed = not self.synchronous and self.rounds.buffer_count > 0  # g(θ_{t-1}) waits in B
        if self.delayed:
            self.rounds.start(estimate=False)
        self.flat.zero_grad()

    def update(self, ctx):
        if self.synchronous:
            self.load_round(self.accum)
            self.rounds.start(estimate=False)
        if self.synchronous or self.delayed:
            self._land_round(ctx)
        if not self.synchronous:
            self.load_round(self.accum)  # g(θ_t), applied next step

    def _land_round(self, ctx):
        self.rounds.wait()
        if self.rounds.skipped and ctx is not None:
            ctx.skip()
        self.rounds.swap_in()
        self.updates += 1

    def rounds_started(self):
        return self.updates + self.rounds.engine.pending

    def finish(self, rounds):
        """The run ends: a round in flight lands (every rank has one in flight, or none);
        the gradient waiting in B for the next step is dropped."""
        if self.rounds.engine.pending:
            self._land_round(None)
            return True
        return False

    def extra_state(self):
        return {**super().extra_state(), "updates": self.updates}

    def load_extra_state(self, sd):
        super().load_extra_state(sd)
        self.updates = sd["updates"]

    def report(self) -> dict:
        return {"optimizer_steps": self.updates, "warmup_steps": self.warmup_steps}

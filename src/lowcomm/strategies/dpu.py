"""DPU -- delayed parameter update (ACCO's ablation baseline).

    θ_{t+1} = opt(θ_t; g(θ_{t-1}))

The round that reduces g(θ_{t-1}) and steps the shard runs on the
communication thread while g(θ_t) is computed, so communication hides behind
compute, at the price of a one-step-stale gradient. The first `warmup_steps`
steps are synchronous ZeRO-1 steps; the first delayed step only computes the
gradient that the next one applies (it sends nothing).

Under --elastic (contract/elastic.py) θ, the optimizer state and the master copy are replicated
(gathered whole and re-cut, as zero1's); the round buffer B, which holds this worker's g(θ_{t-1})
between steps, is its own. A joiner holds none: its first delayed round carries nothing of it
(it takes part as a closed rank does, voting no micro-batch, and the round divides by the
others' count), as DPU's own first delayed step sends nothing. Commit point: every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..comm import CommStats
from ..contract.context import StepContext
from ..engines.flat import ShardedOptions
from ..contract.options import option
from ..contract.parts import attributes
from ..engines.costs_sharded import DpuCost
from ..engines.overlap import OverlappedStrategy
from .registry import register


@dataclass
class DpuOptions(ShardedOptions):
    warmup_steps: int = option(10, "synchronous ZeRO-1 steps before updates become delayed",
                               flag="--dpu-warmup", min=0)


@register("dpu")
class DPU(OverlappedStrategy):
    Options = DpuOptions
    inside_replica = ("ddp", "fsdp")  # across replica groups: on the tensors each position owns (fsdp: its shards)
    cost = DpuCost  # synchronous warm-up, then a round a step behind the next step's compute

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.warmup_steps = self.options.warmup_steps
        self.updates = 0

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(self.updates)
        self.synchronous = self.steps_done < self.warmup_steps
        self.delayed = self.steps_done > self.warmup_steps  # g(θ_{t-1}) waits in B (the first delayed step: none)
        if self.delayed:
            self.launch(estimate=False)
        self.flat.zero_grad()

    def update(self, ctx):
        if self.synchronous:  # the votes first: a replica whose ranks have all closed reduces nothing
            votes = self.votes(ctx.micro)
            self.load_round(ctx.micro) if votes[0] else self.rounds.load_nothing()
            self.launch(estimate=False, votes=votes)
        if (self.synchronous or self.delayed) and not self._land_round(ctx):
            return  # no rank computed: the run is over
        if not self.synchronous:
            self.load_round(ctx.micro)  # g(θ_t), applied next step

    def _land_round(self, ctx) -> bool:
        self.rounds.wait()
        if self.rounds.ended:
            return False
        if self.rounds.skipped:
            ctx.skip()
        self.rounds.swap_in()
        self.updates += 1
        return True

    def serve_step(self):
        """Closed: a step with no micro-batch (a half-accumulated one's are dropped): the
        delayed gradient waiting in B still goes with the round the peers start."""
        ctx = StepContext(self.steps_done, time.perf_counter(), CommStats())
        if not self.rounds.engine.pending:  # not begun, or begun without a round: (again) from its start
            self.begin_step(ctx)
        self.flat.zero_grad()
        self.update(ctx)
        return not self.rounds.ended

    def state_parts(self):
        """The engine's (the module docstring: B and what it counts are this worker's own), the updates."""
        return {**super().state_parts(), **attributes(self, "updates")}

    def report(self) -> dict:
        return {"optimizer_steps": self.updates, "warmup_steps": self.warmup_steps}

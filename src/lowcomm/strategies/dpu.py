"""DPU -- delayed parameter update (ACCO's ablation baseline).

    θ_{t+1} = opt(θ_t; g(θ_{t-1}))

The round that reduces g(θ_{t-1}) and steps the shard runs on the
communication thread while g(θ_t) is computed, so communication hides behind
compute, at the price of a one-step-stale gradient. The first `warmup_steps`
steps are synchronous ZeRO-1 steps; the first delayed step only computes the
gradient that the next one applies.
"""
from __future__ import annotations

from .base import register
from .flat import ShardedStrategy
from .overlap import OverlappedRounds


@register("dpu")
class DPU(ShardedStrategy):
    separate_master = True  # the model keeps θ_t while the round computes θ_{t+1}

    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, warmup_steps=0,
                 param_dtype=None):
        super().__init__(model, comm, make_optimizer, accum, schedule, param_dtype)
        self.warmup_steps = warmup_steps
        self.rounds = OverlappedRounds(self.flat, self.shard_opt, comm)
        self.updates = 0

    def step(self, next_batch, loss_fn):
        tally = self.begin()
        lr = self.lr_for_step(self.shard_opt.optimizer, self.updates)
        synchronous = self.steps_done < self.warmup_steps
        delayed = not synchronous and self.rounds.buffer_count > 0  # g(θ_{t-1}) waits in B
        if delayed:
            self.rounds.start(estimate=False)

        self.flat.zero_grad()
        for _ in range(self.accum):
            self.forward_backward(self.model, next_batch, loss_fn, tally, scale=1.0)
        self.flat.check_views()

        if synchronous:
            self.rounds.load_gradients(self.accum)
            self.rounds.start(estimate=False)
        if synchronous or delayed:
            self.rounds.wait()
            self.rounds.swap_in()
            self.updates += 1
        if not synchronous:
            self.rounds.load_gradients(self.accum)  # g(θ_t), applied next step
        return self.finish(tally, lr)

    def close(self) -> None:
        self.rounds.close()

    def report(self) -> dict:
        return {"optimizer_steps": self.updates, "warmup_steps": self.warmup_steps}

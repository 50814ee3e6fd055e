"""ZeRO-1: sharded optimizer state over a flat gradient buffer.

    G  <- mean of `accum` micro-batch gradients          (local, in flat.grads)
    g_r <- reduce_scatter_mean(G)                         (rank r's shard)
    θ_r <- opt(θ_r; g_r)                                  (state for θ_r only)
    θ  <- all_gather(θ_r)
Wire bytes per step: (W-1)/W·P·b twice = 2(W-1)/W·P·b, DDP's all-reduce.
"""
from __future__ import annotations

import torch

from .base import register
from .flat import ShardedStrategy


@register("zero1")
class Zero1(ShardedStrategy):
    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, param_dtype=None):
        super().__init__(model, comm, make_optimizer, accum, schedule, param_dtype)
        self.shard_grad = torch.empty(self.flat.shard_size, dtype=self.flat.grads.dtype,
                                      device=self.flat.grads.device)

    def step(self, next_batch, loss_fn):
        tally = self.begin()
        lr = self.lr_for_step(self.shard_opt.optimizer, self.steps_done)
        self.flat.zero_grad()
        for _ in range(self.accum):
            self.forward_backward(self.model, next_batch, loss_fn, tally, scale=1.0 / self.accum)
        self.flat.check_views()
        self.comm.reduce_scatter(self.shard_grad, self.flat.grads, op="avg")
        self.shard_opt.step(self.shard_grad)
        self.comm.all_gather(self.flat.params, self.shard_opt.own_params())
        return self.finish(tally, lr)

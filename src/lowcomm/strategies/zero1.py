"""ZeRO-1: sharded optimizer state over a flat gradient buffer.

    G  <- mean of `accum` micro-batch gradients          (local, in flat.grads)
    g_r <- reduce_scatter_mean(G)                         (rank r's shard)
    θ_r <- opt(θ_r; g_r)                                  (state for θ_r only)
    θ  <- all_gather(θ_r)
Wire bytes per step: (W-1)/W·P·b twice = 2(W-1)/W·P·b, DDP's all-reduce.
"""
from __future__ import annotations

import torch

from ..engines.costs_sharded import ShardedCost
from ..engines.flat import ShardedStrategy, flat_bytes
from ..contract.plan import PlannedOp
from .registry import register


@register("zero1")
class Zero1(ShardedStrategy):
    # across replica groups: on the tensors each position owns (fsdp: on its shards, copied into the flat buffer)
    inside_replica = ("ddp", "fsdp")
    cost = ShardedCost  # after the step; 1/W of the optimizer state

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shard_grad = torch.empty(self.flat.shard_size, dtype=self.flat.grads.dtype,
                                      device=self.flat.grads.device)

    @classmethod
    def comm_plan(cls, layout, world, options):
        flat = flat_bytes(layout.numel, world, options)
        return [PlannedOp("reduce_scatter", flat, what="gradients"),
                PlannedOp("all_gather", flat, what="parameters")]

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(ctx.step)
        self.flat.zero_grad()

    def update(self, ctx):
        self.reduce_inside()  # across replica groups: G <- the replica's mean, for the owned tensors
        ctx.poison_nonfinite(self.flat.grads)  # a NaN anywhere reaches every shard: all ranks skip alike
        self.comm.reduce_scatter(self.shard_grad, self.flat.grads, op="avg")
        if ctx.received_finite(self.shard_grad):
            self.shard_opt.step(self.shard_grad)
        self.comm.all_gather(self.flat.params, self.shard_opt.own_params())

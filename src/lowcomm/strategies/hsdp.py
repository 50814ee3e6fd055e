"""ddp across replicas with FSDP inside each (--strategy ddp --inside fsdp): HSDP.

    inside the replica (engines/inside_fsdp.py): each unit's parameters all-gathered for
        the forward and the backward, its gradients reduce-scattered (mean) to this rank's shard
    G_shard <- mean over the R replicas of this rank's gradient shard   (one all-reduce, across)
    θ_shard <- AdamW(θ_shard; G_shard)     optimizer state of this shard only: 1/K of ddp's

Not torch's own HSDP (fully_shard on a 2-D mesh): its all-reduce across replicas would bypass
Comm. Here it runs on the cross-replica Comm like every strategy's traffic, once per step after
the backward (not overlapped with it, as ddp's buckets are). The run is named `ddp`: the same
algorithm, another engine inside (InsideFSDP.strategy_class picks this class).
"""
from __future__ import annotations

from ..contract.base import Strategy
from ..contract.context import flat_of, write_flat
from .ddp import DDP, DDPOptions


class HSDP(Strategy):
    name = "ddp"
    Options = DDPOptions  # the run's flags are ddp's (bucket_mb: FSDP's units are the buckets here)
    inside_replica = ("fsdp",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = self.make_optimizer(self.params)  # on this rank's shards

    @classmethod
    def comm_plan(cls, layout, world, options):
        return DDP.comm_plan(layout, world, options)  # the gradient (here: of a shard) all-reduced, fp32

    def update(self, ctx):
        self.reduce_inside()  # this rank's shard of the replica's mean gradient
        grads = [p.grad for p in self.params]
        flat = flat_of(grads)
        self.comm.all_reduce(flat, op="avg")
        write_flat(flat, grads)
        # The all-reduce carried any NaN to every replica: all skip alike (StepContext.received_finite).
        if ctx.received_finite(flat):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

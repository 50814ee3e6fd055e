"""DDP: torch's DistributedDataParallel, its bucketed all-reduce routed through Comm.

The comm hook keeps DDP's overlap of all-reduce with backward intact while
Comm counts every bucket's bytes. The time a rank waits for the last buckets
after its backward compute ends is DDP's exposed communication. (No `from __future__ import annotations` here: DDP
checks the comm hook's return annotation at runtime.)
"""
import time
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..comm import Comm
from .base import Strategy, register


def counted_allreduce_hook(comm: Comm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's default allreduce hook (mean), through Comm."""
    handle = comm.all_reduce(bucket.buffer(), op="avg", async_op=True)
    return handle.future.then(lambda f: f.value()[0])


def paced_allreduce_hook(strategy: "DDP", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """counted_allreduce_hook, after paying the emulated slowdown of the compute
    so far: a slower device would issue this bucket that much later, and the
    peers must wait for it inside the all-reduce, not at some later sync point."""
    if strategy.pacer is not None:
        strategy.pacer.pay(strategy.steps_done, strategy.comm.tracer)
    return counted_allreduce_hook(strategy.comm, bucket)


@register("ddp")
class DDP(Strategy):
    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, bucket_mb=25.0):
        super().__init__(model, comm, make_optimizer, accum, schedule)
        self.ddp = DistributedDataParallel(model, process_group=comm.group, bucket_cap_mb=bucket_mb)
        # A proxy, not self: DDP's C++ reducer keeps the state alive, and a
        # strategy <-> reducer cycle left for the garbage collector at exit
        # tears DDP down in the wrong order (SIGABRT, 'terminate called').
        self.ddp.register_comm_hook(weakref.proxy(self), paced_allreduce_hook)
        self.optimizer = make_optimizer(model.parameters())

    def optimizers(self):
        return [self.optimizer]

    def step(self, next_batch, loss_fn):
        tally = self.begin()
        lr = self.lr_for_step(self.optimizer, self.steps_done)
        for i in range(self.accum - 1):
            self.forward_backward(self.ddp, next_batch, loss_fn, tally, 1.0 / self.accum,
                                  context=self.ddp.no_sync())
        # The last micro-batch all-reduces during its backward; whatever runs
        # after its last bucket was issued is waiting on the network.
        compute_before = tally.compute_s
        self.forward_backward(self.ddp, next_batch, loss_fn, tally, 1.0 / self.accum,
                              pace=False)  # the hook paces it, before each bucket is sent
        if self.comm.world > 1:
            waited = time.perf_counter() - self.comm.last_issue_s
            exposed = max(0.0, min(waited, tally.compute_s - compute_before))
            self.comm.add_exposed(exposed)
            tally.compute_s -= exposed
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.finish(tally, lr)

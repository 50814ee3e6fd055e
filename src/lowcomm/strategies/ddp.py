"""DDP: torch's DistributedDataParallel, its bucketed all-reduce routed through Comm.

    for each micro-batch but the last:  backward without sync (DDP's no_sync)
    last micro-batch:                   backward; DDP all-reduces (mean) bucket by bucket
    θ <- opt(θ; mean gradient)

The comm hook keeps DDP's overlap of all-reduce with backward intact while Comm counts every bucket's
bytes; the wait for the last buckets after the backward ends is DDP's exposed communication (the plan
prices it: engines/costs.py). No `from __future__ import annotations`: DDP checks the hook's annotation.

Across replica groups (--replicas): each bucket reduce-scattered inside the replica, this
rank's 1/K all-reduced across replicas (overlapped as above), all-gathered inside at the end.

In a process without a group (the Python API's single process) there is no DDP (torch's reducer needs
a group): the step's gradients go through the same comm hook as one bucket after the last backward
(Comm does the collective's local effect), and the forward runs on `SingleProcess`, DDP's shape
(`.module`), so a loop that reaches its model as `run.model.module` runs alone as under torchrun.
"""
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import Comm
from ..comm.torch_hooks import OwnedBucket
from ..errors import UsageError
from ..contract.base import Strategy
from ..contract.context import write_flat
from ..contract.options import Options, option
from ..contract.plan import PlannedOp
from ..engines.costs import BucketedAllReduce
from .registry import register


@dataclass
class DDPOptions(Options):
    bucket_mb: float = option(25.0, "DDP gradient bucket size in MB", above=0)


def counted_allreduce_hook(comm: Comm, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's default allreduce hook (mean), through Comm."""
    handle = comm.all_reduce(bucket.buffer(), op="avg", async_op=True)
    return handle.future.then(lambda f: f.value()[0])


def paced_hook(strategy: "DDP", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook DDP calls for every bucket: pay the emulated slowdown of the compute so far
    (a slower device would issue this bucket that much later, and the peers must wait for
    it inside the reduction, not at some later sync point), then the strategy's comm_hook
    (across replica groups: replica_hook, each position's piece of the bucket across)."""
    strategy.pace()
    strategy.buckets_sent += 1
    if strategy.inside is not None:
        return strategy.replica_hook(bucket)
    return strategy.comm_hook(bucket)


class SingleProcess(nn.Module):
    """The training module of ddp in a process without a group: DDP's shape (the model as
    `.module`, its forward) without DDP's reducer."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@register("ddp")
class DDP(Strategy):
    Options = DDPOptions
    inside_replica = ("ddp", "fsdp")  # across replica groups: HSDP's split by position (comm = cross); fsdp: hsdp.py
    owns_tensors = False  # splits each bucket by position instead (replica_hook)
    cost = BucketedAllReduce  # the buckets behind the last backward; across replica groups HSDP's split

    @classmethod
    def fsdp_form(cls) -> type:
        """ddp with FSDP inside is HSDP (hsdp.py); a subclass (powersgd) runs as it is."""
        from .hsdp import HSDP
        return HSDP if cls is DDP else cls

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        self.wrap_in_ddp(model, comm, make_optimizer)

    def wrap_in_ddp(self, model, comm, make_optimizer) -> None:
        self.buckets_sent = 0  # in the current step: none after a synced backward means DDP was bypassed
        self.pieces = []  # across replica groups: (parameters, piece, numel) of each bucket this step
        if self.owns_part or not dist.is_initialized():
            # No reducer (see the module docstring): across replica groups a subclass runs on the
            # tensors its position owns (powersgd); in a single process torch's DDP has no group.
            self.ddp = None
            self.local_model = model if self.owns_part else SingleProcess(model)
            self.optimizer = make_optimizer(self.params if self.owns_part else model.parameters())
            return
        self.ddp = DistributedDataParallel(model, process_group=comm.group,
                                           bucket_cap_mb=self.options.bucket_mb)
        # A proxy, not self: DDP's C++ reducer keeps the state alive, and a
        # strategy <-> reducer cycle left for the garbage collector at exit
        # tears DDP down in the wrong order (SIGABRT, 'terminate called').
        self.ddp.register_comm_hook(weakref.proxy(self), paced_hook)
        self.optimizer = make_optimizer(model.parameters())

    def comm_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """How one bucket of gradients is reduced (the seam subclasses replace, e.g. powersgd):
        here torch's default all-reduce (mean), through Comm."""
        return counted_allreduce_hook(self.comm, bucket)

    def replica_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Across replica groups: the bucket reduce-scattered inside the replica, this rank's
        piece (its position's 1/K) all-reduced across replicas behind the rest of the backward;
        the pieces are all-gathered inside the replica once the backward ends (gather_pieces)."""
        buffer = bucket.buffer()
        piece = self.inside.scatter(buffer)
        self.pieces.append((bucket.parameters(), piece, buffer.numel()))
        handle = self.comm.all_reduce(piece, op="avg", async_op=True)
        return handle.future.then(lambda f: buffer)

    def gather_pieces(self) -> None:
        """Every bucket's reduced pieces all-gathered inside the replica, into the gradients."""
        for params, piece, numel in self.pieces:
            write_flat(self.inside.gather(piece, numel), [p.grad for p in params], like=params)
        self.pieces = []

    @property
    def train_model(self):
        return self.ddp if self.ddp is not None else self.local_model

    @classmethod
    def comm_plan(cls, layout, world, options):
        return [PlannedOp("all_reduce", 4 * layout.numel, what="gradients (fp32, in buckets)")]

    def _sync_next(self, last: bool) -> None:
        """Whether the next micro-batch's backward all-reduces: what DDP's no_sync()
        toggles, set here because the user's forward runs outside our code. DDP reads
        it in forward, so it must be right before the next forward begins."""
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = last

    def _update_unwrapped(self, ctx) -> None:
        """Without DDP: the step's gradients (across replica groups: the replica's mean of the
        owned ones) through comm_hook as one bucket, then the step."""
        self.reduce_inside()
        params = [p for p in self.params if p.grad is not None]
        bucket = OwnedBucket(params)
        ctx.poison_nonfinite(bucket.buffer())
        reduced = self.comm_hook(bucket).wait()
        write_flat(reduced, [p.grad for p in params])
        if ctx.received_finite(reduced):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(ctx.step)
        self.buckets_sent = 0
        self._sync_next(self.accum == 1)

    def paces_backward(self):
        # with DDP, the hook paces before each bucket of a synced backward
        return self.ddp is None or not self.ddp.require_backward_grad_sync

    def after_backward(self, ctx):
        if ctx.micro < self.accum:
            self._sync_next(ctx.micro + 1 == self.accum)
            return False
        self.update(ctx)
        return True

    def update(self, ctx):
        if self.ddp is None:
            self._update_unwrapped(ctx)
            return
        if self.buckets_sent == 0:
            raise UsageError("the loss was not computed through the DDP wrapper, so no gradient was "
                             "all-reduced: run the forward on run.model (strategy.train_model), not on "
                             "the model you passed in")
        # The last micro-batch all-reduced during its backward; whatever ran
        # after its last bucket was issued was waiting on the network.
        if self.comm.world > 1:
            # Measured to the end of that backward, so the wait is the tail of its
            # micro-batch span (nested in it, as the trace draws it).
            end = ctx.last_compute_end
            exposed = max(0.0, min(end - self.comm.last_issue_s, ctx.last_compute_s))
            self.comm.add_exposed(exposed, end=end)
            ctx.compute_s -= exposed
        if self.inside is not None:
            self.gather_pieces()
        # The all-reduce carried any NaN to every rank: all skip alike (see StepContext.received_finite).
        if ctx.received_finite(*(p.grad for p in self.model.parameters() if p.grad is not None)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_next(self.accum == 1)

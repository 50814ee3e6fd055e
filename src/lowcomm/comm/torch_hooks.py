"""torch's own DDP comm hooks (e.g. `powerSGD_hook`), unchanged, with their collectives through
a Comm, so that they are counted, timed and slowed by an emulated link like every other byte.

    group = CountedGroup(comm)                 # what the hook's state takes as its process group
    route_collectives(powerSGD_hook, default_hooks)   # the modules that issue the hook's collectives
    chain = BucketChain()
    def comm_hook(bucket):                     # DDP's hook: buckets reduced one after another
        return chain.run(lambda: powerSGD_hook(state, bucket))

A routed module sees a `torch.distributed` whose `all_reduce` sends a CountedGroup's ops through
its Comm; every other call goes to torch as is.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class CountedGroup:
    """What a hook believes is its process group: the real one plus the Comm to use."""

    def __init__(self, comm):
        self.comm = comm

    @property
    def group(self):
        """The real group, looked up when asked: held, the default group would outlive
        destroy_process_group() (run/teardown.py)."""
        return self.comm.group if self.comm.group is not None else dist.group.WORLD

    def size(self):
        return self.comm.world

    def rank(self):
        return self.comm.rank


class CountedWork:
    """A Comm handle as the Work object torch's hooks expect from an async all_reduce."""

    def __init__(self, handle):
        self._handle = handle

    def get_future(self):
        return self._handle.future

    def wait(self):
        self._handle.wait()
        return True

    def is_completed(self):
        return self._handle.is_completed()


class RoutedDist:
    """torch.distributed, except that all_reduce on a CountedGroup goes through its Comm."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not isinstance(group, CountedGroup):
            return self._real.all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op != dist.ReduceOp.SUM:
            raise NotImplementedError("only sum all-reduces are routed through Comm")
        handle = group.comm.all_reduce(tensor, op="sum", async_op=True)
        if not async_op:
            handle.wait()
            return None
        return CountedWork(handle)


def route_collectives(*modules) -> None:
    """Give each module (one that did `import torch.distributed as dist`) the routed dist; once."""
    for module in modules:
        if not isinstance(module.dist, RoutedDist):
            module.dist = RoutedDist(module.dist)


class OwnedBucket:
    """Gradients as DDP's GradBucket shows them to a comm hook, outside DDP: one bucket, the
    last, of `params`' gradients end to end (what torch's hooks read of a GradBucket)."""

    def __init__(self, params: list[torch.Tensor]):
        self._params = params
        self._buffer = torch.cat([p.grad.reshape(-1) for p in params])

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        views, at = [], 0
        for p in self._params:
            views.append(self._buffer[at:at + p.numel()].view_as(p))
            at += p.numel()
        return views

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class BucketChain:
    """DDP buckets reduced one after another. A hook whose collectives are chained by future
    callbacks (PowerSGD's three all-reduces per bucket) runs them on whichever thread completes
    the previous one; with several buckets in flight, bucket b's second all-reduce and bucket
    b+1's first were issued in an order that differed between ranks (gloo: 'Received data size
    doesn't match', or a hang). So each bucket starts when the previous bucket's chain is done:
    every rank issues the same sequence, and backward still overlaps it."""

    def __init__(self):
        self._last: torch.futures.Future | None = None  # the latest bucket's reduction

    def run(self, start: Callable[[], torch.futures.Future]) -> torch.futures.Future:
        """`start()` once the previous bucket is reduced; a future of its result (or exception)."""
        done = torch.futures.Future()

        def begin(_=None):
            try:
                start().add_done_callback(finish)
            except Exception as e:  # noqa: BLE001 -- handed to DDP, which raises it in backward
                done.set_exception(e)

        def finish(fut):
            try:
                done.set_result(fut.value())
            except Exception as e:  # noqa: BLE001
                done.set_exception(e)

        prev, self._last = self._last, done
        if prev is None or prev.done():
            begin()
        else:
            prev.add_done_callback(begin)
        return done

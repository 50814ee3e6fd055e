"""ZeRO-1 rounds on a background thread, beside gradient accumulation (ACCO, DPU).

One round, on the communication thread:
    N    = all_reduce(count)          async, beside the reduce-scatter
    g_r  = reduce_scatter(B) / N      B holds a gradient *sum* over N micro-batches
    θ_r' = opt(θ_r; g_r)              an estimate round snapshots and restores the shard
    B    = all_gather(θ_r')           B now holds the round's parameters
while the compute thread keeps accumulating gradients into the model's flat
gradient buffer G. Afterwards `swap_in()` loads B's parameters into the model
and `load_gradients()` hands G over as the next round's B.

CPU: a single worker thread runs the round with async collectives; waits there
are overlapped time, not exposed (Comm.overlapped). GPU: the round also runs
on its own CUDA stream, ordered against the compute stream by events, so the
compute thread never waits on the host for communication.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from ..comm import Comm
from .flat import FlatModel, ShardOptimizer


class OverlappedRounds:
    def __init__(self, flat: FlatModel, shard_opt: ShardOptimizer, comm: Comm):
        self.flat, self.shard_opt, self.comm = flat, shard_opt, comm
        self.buffer = torch.zeros_like(flat.params)  # B: gradient sum out, parameters back
        self.buffer_count = 0                        # micro-batches summed in B (0: nothing to send)
        self.shard_grad = torch.empty(flat.shard_size, dtype=flat.grads.dtype, device=flat.grads.device)
        self.snapshot_bytes = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowcomm-comm")
        self._pending: Future | None = None
        cuda = flat.params.is_cuda
        self._stream = torch.cuda.Stream(device=flat.params.device) if cuda else None
        self._done = torch.cuda.Event() if cuda else None

    # -- compute-thread side --------------------------------------------------
    def load_gradients(self, count: int) -> None:
        """B <- G, the gradient sum of `count` local micro-batches."""
        self.buffer.copy_(self.flat.grads)
        self.buffer_count = count

    def start(self, estimate: bool) -> None:
        """Launch a round on B. An estimate round leaves the shard and its optimizer state untouched."""
        assert self._pending is None and self.buffer_count > 0
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        count, self.buffer_count = self.buffer_count, 0
        self._pending = self._pool.submit(self._round, count, estimate, ready)

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def wait(self) -> int:
        """Block until the round is done (the block is exposed time); return the global count N."""
        t0 = time.perf_counter()
        total = self._pending.result()
        self._pending = None
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        self.comm.add_exposed(time.perf_counter() - t0)
        return total

    def swap_in(self) -> None:
        """Model parameters <- the parameters the round gathered into B."""
        self.flat.params.copy_(self.buffer)

    # -- communication-thread side -------------------------------------------
    def _round(self, count: int, estimate: bool, ready) -> int:
        if self._stream is not None:  # the current device is per thread: set it here too
            torch.cuda.set_device(self.buffer.device)
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with self.comm.overlapped(), stream_ctx:
            if ready is not None:
                self._stream.wait_event(ready)
            n = torch.tensor([float(count)], dtype=torch.float64, device=self.buffer.device)
            counting = self.comm.all_reduce(n, op="sum", async_op=True)
            reducing = self.comm.reduce_scatter(self.shard_grad, self.buffer, op="sum", async_op=True)
            counting.wait()
            reducing.wait()
            self.shard_grad.div_(n)  # every micro-batch weighs the same, whoever computed it
            saved = self.shard_opt.snapshot() if estimate else None
            if saved is not None:
                self.snapshot_bytes = max(self.snapshot_bytes, sum(t.numel() * t.element_size() for t in saved))
            self.shard_opt.step(self.shard_grad)
            self.comm.all_gather(self.buffer, self.shard_opt.own_params())
            if saved is not None:
                self.shard_opt.restore(saved)
            if self._done is not None:
                self._done.record(self._stream)
            return int(n.item())

    def close(self) -> None:
        self._pool.shutdown(wait=True)


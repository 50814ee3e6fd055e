"""Communication beside compute: a generic background engine, and ZeRO-1 rounds on it.

`Background` runs one job at a time on a communication thread. Its waits are
overlapped time, not exposed (Comm.overlapped); only the compute thread's own
block in `wait()` is exposed. On GPU a job also runs on its own CUDA stream,
ordered against the compute stream by events, so the compute thread never
waits on the host for communication. The shape is prepare / perform / wait
(torchft's Streaming DiLoCo has the same), so ACCO, DPU, Streaming DiLoCo's
fragment syncs and compressed all-reduces can all be clients.

`OverlappedRounds` is the ZeRO-1 round client (ACCO, DPU). One round:
    N    = all_reduce(count)          async, beside the reduce-scatter
    g_r  = reduce_scatter(B) / N      B holds a gradient *sum* over N micro-batches
    θ_r' = opt(θ_r; g_r)              an estimate round snapshots and restores the shard
    B    = all_gather(θ_r')           B now holds the round's parameters
while the compute thread keeps accumulating gradients into the model's flat
gradient buffer G. Afterwards `swap_in()` loads B's parameters into the model
and `load_gradients()` hands G over as the next round's B.

The end of a run is agreed inside the rounds, not beside them. How many rounds a
rank starts can depend on timing (adaptive ACCO ends equal backward() counts on
different round counts), so a rank that has closed cannot know how many more its
peers will start, and an agreement beside the rounds would wait for a peer that
waits in a round. Instead the count travels with a vote, [N, computing ranks]:
a rank that has closed (`open` False) keeps starting rounds as a looping rank
would, with no new micro-batches, and votes 0; it waits for the votes before
sending more. A round in which no rank computes carries nothing (every rank skips
its reduce-scatter and all-gather alike) and ends the run on every rank at once.
A closed rank's vote is bookkeeping (meta), as the agreement it replaces was.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable

import torch

from ..comm import Comm
from ..contract.context import all_finite, fill_nan_if_nonfinite
from .flat import FlatModel, ShardedStrategy, ShardOptimizer, flat_bytes
from .inside import replica_sum
from ..contract.parts import LOCAL, Part, attributes
from ..contract.plan import PlannedOp
from .flat_reshard import Repadded


class Background:
    """One communication job at a time on its own thread (and CUDA stream)."""

    def __init__(self, comm: Comm, device: torch.device):
        self.comm, self.device = comm, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lowcomm-comm")
        self._pending: Future | None = None
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if cuda else None
        self._done = torch.cuda.Event() if cuda else None

    def submit(self, job: Callable[..., Any], *args) -> None:
        """Start `job(*args)` on the communication thread, after the compute stream's work so far."""
        assert self._pending is None, "a background job is already in flight"
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()
        self._pending = self._pool.submit(self._run, job, args, ready)

    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    @property
    def pending(self) -> bool:
        """A job was submitted and not yet waited for (done or not)."""
        return self._pending is not None

    def wait(self) -> Any:
        """Block until the job is done (the block is exposed time); return its result."""
        t0 = time.perf_counter()
        result = self._pending.result()
        self._pending = None
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)
        self.comm.add_exposed(time.perf_counter() - t0)
        return result

    def _run(self, job, args, ready):
        if self._stream is not None:  # the current device is per thread: set it here too
            torch.cuda.set_device(self.device)
        stream_ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with self.comm.overlapped(), stream_ctx:
            if ready is not None:
                self._stream.wait_event(ready)
            result = job(*args)
            if self._done is not None:
                self._done.record(self._stream)
            return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class OverlappedRounds:
    def __init__(self, flat: FlatModel, shard_opt: ShardOptimizer, comm: Comm):
        self.flat, self.shard_opt, self.comm = flat, shard_opt, comm
        self.buffer = torch.zeros_like(flat.params)  # B: gradient sum out, parameters back
        self.buffer_count = 0                        # micro-batches summed in B (0: nothing to send)
        self.shard_grad = torch.empty(flat.shard_size, dtype=flat.grads.dtype, device=flat.grads.device)
        self.snapshot_bytes = 0
        self.skipped = False  # the last round's update was not applied (a non-finite gradient somewhere)
        self.open = True      # this rank still computes micro-batches (False once closed: it serves rounds)
        self.ended = False    # the last round found no rank computing: it carried nothing, the run is over
        self.engine = Background(comm, flat.params.device)

    # -- compute-thread side --------------------------------------------------
    def load_gradients(self, count: int) -> None:
        """B <- G, the gradient sum of `count` local micro-batches."""
        self.buffer.copy_(self.flat.grads)
        self.buffer_count = count

    def load_nothing(self) -> None:
        """B <- 0: no micro-batch (what reducing a closed replica's zero gradients would give)."""
        self.buffer.zero_()
        self.buffer_count = 0

    def start(self, estimate: bool, count: int, computing: int) -> None:
        """Launch a round on B, of `count` micro-batches with `computing` ranks' votes (this
        rank's; across replica groups its replica's). An estimate round leaves the shard and
        its optimizer state untouched."""
        assert count > 0 or not computing, "a computing rank starts a round with no micro-batch"
        self.buffer_count = 0
        self.engine.submit(self._round, count, computing, estimate)

    def in_flight(self) -> bool:
        return self.engine.in_flight()

    def wait(self) -> int:
        """Block until the round is done; return the global micro-batch count N (`ended`: no
        rank computed, nothing was sent or changed)."""
        total, self.ended = self.engine.wait()
        return total

    def swap_in(self) -> None:
        """Model parameters <- the parameters the round gathered into B."""
        self.flat.params.copy_(self.buffer)

    def saved_buffer(self) -> torch.Tensor:
        assert not self.engine.pending, "state taken while a round is in flight"
        return self.buffer.clone()

    # -- communication-thread side -------------------------------------------
    def _round(self, count: int, computing: int, estimate: bool) -> tuple[int, bool]:
        n = torch.tensor([float(count), float(computing)], dtype=torch.float64, device=self.buffer.device)
        fill_nan_if_nonfinite(self.buffer)  # a NaN reaches every rank's shard: all skip the round alike
        if computing:  # the round goes on whatever the others vote: the count beside the reduction
            counting = self.comm.all_reduce(n, op="sum", async_op=True)
        else:  # closed: learn whether anyone still computes before sending more
            counting = self.comm.meta_all_reduce(n)
            if n[1].item() == 0:
                return 0, True
        reducing = self.comm.reduce_scatter(self.shard_grad, self.buffer, op="sum", async_op=True)
        if computing:
            counting.wait()
        reducing.wait()
        self.shard_grad.div_(n[0])  # every micro-batch weighs the same, whoever computed it
        self.skipped = not all_finite(self.shard_grad)
        saved = self.shard_opt.snapshot() if estimate and not self.skipped else None
        if saved is not None:
            self.snapshot_bytes = max(self.snapshot_bytes, sum(t.numel() * t.element_size() for t in saved))
        if not self.skipped:
            self.shard_opt.step(self.shard_grad)
        self.comm.all_gather(self.buffer, self.shard_opt.own_params())
        if saved is not None:
            self.shard_opt.restore(saved)
        return int(n[0].item()), False

    @staticmethod
    def plan(flat_bytes: int) -> list[PlannedOp]:
        """One round's traffic: the count and votes, the gradient sum, the gathered parameters."""
        return [PlannedOp("all_reduce", 16, what="micro-batch count and computing ranks (2 float64)"),
                PlannedOp("reduce_scatter", flat_bytes, what="gradient sum"),
                PlannedOp("all_gather", flat_bytes, what="parameters")]

    def use_comm(self, comm: Comm) -> None:
        """Between rounds: the next rounds run on `comm`."""
        assert not self.engine.pending, "the group changed while a round is in flight"
        self.comm = self.engine.comm = comm

    def close(self) -> None:
        self.engine.close()


VOTES = PlannedOp("all_reduce", 16, what="micro-batch count and computing ranks inside the replica (2 float64)")


class OverlappedStrategy(ShardedStrategy):
    """ZeRO-1's layout with its rounds beside compute (acco, dpu): micro-batch gradients are
    summed (a round divides by the global count N), and the fp32 master is kept apart from
    the parameters the model holds while a round computes the next ones."""

    separate_master = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds = OverlappedRounds(self.flat, self.shard_opt, self.comm)

    @classmethod
    def comm_plan(cls, layout, world, options):
        return OverlappedRounds.plan(flat_bytes(layout.numel, world, options))  # per round = per step

    def load_round(self, count: int) -> None:
        """The next round's B <- G of `count` micro-batches (across replica groups: the replica's
        sum of the owned gradients)."""
        self.reduce_inside(op="sum")
        self.rounds.load_gradients(count)

    def votes(self, count: int) -> tuple[int, int]:
        """(micro-batches, computing ranks) a round starts with: this rank's; across replica groups
        its replica's, summed inside as the round starts, so that every position of a replica
        sends the same (a replica ends the run only when all its ranks have closed)."""
        computing = int(self.rounds.open)
        if self.inside is None:
            return count, computing
        return replica_sum(self.inside.comm, (count, computing), self.flat.grads.device, counted=computing > 0)

    def round_in_flight(self) -> bool:
        """Whether the round is still in flight, as the whole replica sees it: across replica
        groups every position must compute the same micro-batches (with FSDP inside a micro-batch
        is itself collective: a position that computed one more than the others would wait for
        them for ever), so the replica goes on only while the round is in flight on all of its
        positions (one 8-byte all-reduce per micro-batch past --accum)."""
        in_flight = self.rounds.in_flight()
        if self.inside is None:
            return in_flight
        return replica_sum(self.inside.comm, (int(in_flight),), self.flat.grads.device)[0] == self.inside.comm.world

    def launch(self, estimate: bool, votes: tuple[int, int] | None = None) -> None:
        """Start the round on B with its votes (default: those of the micro-batches B holds). A
        computing rank whose B holds none is an elastic joiner (its B is a fresh worker's:
        contract/elastic.py), until its first round: it votes no micro-batch, as a closed rank
        does (the round divides by the others' count), and contributes from its next. Read from
        B, not from a flag set at the join, so that it holds when the membership re-forms again
        before that round (the member then reloads its own snapshot, B as it joined with it)."""
        if votes is None and self.rounds.open and self.rounds.buffer_count == 0:
            votes = (0, 0)  # every process of a joiner replica alike: each holds a fresh B
        self.rounds.start(estimate, *(votes or self.votes(self.rounds.buffer_count)))

    def end_run(self, agree) -> bool:
        """The run ends (collective; the driver's close): this rank stops computing and keeps
        taking part in rounds as a looping rank with no micro-batches would (`serve_step`,
        sharing inside its replica after each as the driver does after a step), until a round
        finds no rank computing (see the module docstring). No agreement beside the rounds."""
        self.rounds.open = False
        while self.serve_step():
            self.steps_done += 1
            self.share_inside()
        self.settle()
        return False

    def serve_step(self) -> bool:
        """One step with no micro-batch, as this strategy's loop would take it: False when its
        round found no rank computing (the run is over)."""
        raise NotImplementedError

    def settle(self) -> None:
        """After the last round: leave the final parameters in the model (default: they are)."""

    def loss_scale(self) -> float:
        return 1.0

    def state_parts(self):
        """ZeRO-1's, and the round buffer B with the micro-batches it holds: this worker's own (a
        joiner's holds none, see launch), in its world's padding (re-padded for another membership)."""
        return {**super().state_parts(),
                "buffer": Part(self.rounds.saved_buffer, self.rounds.buffer.copy_, LOCAL,
                               layout=Repadded(self.rounds.buffer)),
                **attributes(self.rounds, "buffer_count", kind=LOCAL)}

    def extra_memory_bytes(self) -> int:
        """Bytes held beyond ZeRO-1, measured on the live tensors: the communication buffer B, the
        separate fp32 master shard (ZeRO-1 aliases it to the fp32 parameters) and the peak
        estimate-round snapshot (acco's)."""
        b, m = self.rounds.buffer, self.shard_opt.master
        zero1_aliases = self.flat.params.dtype == m.dtype
        return (b.numel() * b.element_size() + (m.numel() * m.element_size() if zero1_aliases else 0)
                + self.rounds.snapshot_bytes)

    def use_comm(self, comm: Comm) -> None:
        super().use_comm(comm)
        self.rounds.use_comm(comm)

    def release(self) -> None:
        super().release()
        self.rounds.close()

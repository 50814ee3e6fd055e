"""Comm: the only caller of torch.distributed collectives in lowcomm.

Every collective passes through here so that its ring-model wire bytes
(wire.py) and its time are counted per rank. Strategies read the counters
as deltas around a step (`CommStats` supports subtraction).

Time is split the way a user cares about it:
- busy_s: how long ops were in flight (issue -> completion), overlapped or not;
- exposed_s: how long this rank was blocked waiting on the network. A sync op
  is exposed for its whole duration; an async op only for the time its
  `wait()` blocks. Strategies whose waiting happens inside torch (DDP's
  reducer) report it through `add_exposed`.
Bookkeeping traffic (metrics, checksums) goes through `meta_*` and is counted
apart from the strategy's own bytes.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .wire import wire_bytes

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


@dataclass
class CommStats:
    wire_bytes: int = 0
    ops: int = 0
    busy_s: float = 0.0
    exposed_s: float = 0.0

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def copy(self) -> "CommStats":
        return CommStats(*(getattr(self, f.name) for f in fields(self)))


class Handle:
    """An in-flight collective. `wait()` blocks until it is done, counts the
    blocked time as exposed, and returns the op's result tensor."""

    def __init__(self, comm: "Comm", work, result: torch.Tensor | None):
        self._comm = comm
        self._work = work
        self.result = result
        self._waited = False

    @property
    def future(self) -> torch.futures.Future:
        """A torch Future whose value is a list holding the result, like c10d's."""
        if self._work is None:  # W == 1: nothing was sent
            fut = torch.futures.Future()
            fut.set_result([self.result])
            return fut
        return self._work.get_future()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor | None:
        if not self._waited:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
                self._comm._sync_device(self.result)
            self._comm._add(exposed_s=time.perf_counter() - t0)
            self._waited = True
        return self.result


class Comm:
    """Counts and times every collective on one process group."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.backend = dist.get_backend(group) if dist.is_initialized() else "none"
        self.stats = CommStats()
        self.by_op: dict[str, CommStats] = {}
        self.meta = CommStats()
        self.last_issue_s = 0.0  # perf_counter() of the latest issue (DDP's exposed time)
        self._lock = threading.Lock()

    # -- accounting ---------------------------------------------------------
    def snapshot(self) -> CommStats:
        with self._lock:
            return self.stats.copy()

    def add_exposed(self, seconds: float) -> None:
        self._add(exposed_s=seconds)

    def _add(self, op: str | None = None, wire: int = 0, ops: int = 0,
             busy_s: float = 0.0, exposed_s: float = 0.0, meta: bool = False) -> None:
        with self._lock:
            targets = [self.meta] if meta else [self.stats]
            if op is not None and not meta:
                targets.append(self.by_op.setdefault(op, CommStats()))
            for s in targets:
                s.wire_bytes += wire
                s.ops += ops
                s.busy_s += busy_s
                s.exposed_s += exposed_s

    def _sync_device(self, tensor: torch.Tensor | None) -> None:
        # NCCL's wait() only orders streams; timing needs the host to wait too.
        if tensor is not None and tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def _run(self, op: str, nbytes: int, launch, result, async_op: bool, meta: bool = False):
        wire = wire_bytes(op, nbytes, self.world)
        if self.world == 1:
            self._add(op, 0, 1, meta=meta)
            return Handle(self, None, result) if async_op else None
        t0 = time.perf_counter()
        self.last_issue_s = t0
        if not async_op:
            launch(False)
            self._sync_device(result)
            dt = time.perf_counter() - t0
            self._add(op, wire, 1, busy_s=dt, exposed_s=dt, meta=meta)
            return None
        work = launch(True)
        self._add(op, wire, 1, meta=meta)

        def done(_fut, t0=t0):
            self._add(op, busy_s=time.perf_counter() - t0, meta=meta)
        work.get_future().add_done_callback(done)
        return Handle(self, work, result)

    # -- collectives --------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """In place. Ring bytes 2(W-1)/W * S."""
        red = _REDUCE_OPS[op]
        return self._run("all_reduce", _nbytes(tensor),
                         lambda a: dist.all_reduce(tensor, op=red, group=self.group, async_op=a),
                         tensor, async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       async_op: bool = False):
        """output (S/W) <- reduction of this rank's chunk of input (S).
        Bytes are the ring reduce-scatter's (W-1)/W * S. Note: gloo has no
        native reduce-scatter; torch runs a full all-reduce and keeps a chunk,
        so on gloo the real transport moves twice the counted bytes. The count
        stays the ring formula because that is what NCCL (and the planner) pay."""
        red = _REDUCE_OPS[op]
        return self._run("reduce_scatter", _nbytes(input),
                         lambda a: dist.reduce_scatter_single(output, input, op=red,
                                                              group=self.group, async_op=a),
                         output, async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output (W * s) <- concatenation of every rank's input (s).
        Bytes (W-1)/W * S with S the gathered size, i.e. (W-1) * s."""
        return self._run("all_gather", _nbytes(output),
                         lambda a: dist.all_gather_single(output, input, group=self.group, async_op=a),
                         output, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Bytes S (pipelined ring)."""
        return self._run("broadcast", _nbytes(tensor),
                         lambda a: dist.broadcast(tensor, src=src, group=self.group, async_op=a),
                         tensor, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Equal splits. Bytes (W-1)/W * S with S the send buffer."""
        return self._run("all_to_all", _nbytes(input),
                         lambda a: dist.all_to_all_single(output, input, group=self.group, async_op=a),
                         output, async_op)

    # -- bookkeeping (not strategy traffic) ---------------------------------
    def meta_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        red = _REDUCE_OPS[op]
        self._run("all_reduce", _nbytes(tensor),
                  lambda a: dist.all_reduce(tensor, op=red, group=self.group, async_op=a),
                  tensor, False, meta=True)
        return tensor

    def meta_all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns a (W, *tensor.shape) tensor of every rank's values."""
        flat = tensor.reshape(-1).contiguous()
        out = torch.empty(self.world * flat.numel(), dtype=tensor.dtype, device=tensor.device)
        if self.world == 1:
            out.copy_(flat)
        else:
            self._run("all_gather", _nbytes(out),
                      lambda a: dist.all_gather_single(out, flat, group=self.group, async_op=a),
                      out, False, meta=True)
        return out.view(self.world, *tensor.shape)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

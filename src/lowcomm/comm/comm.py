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
Bookkeeping traffic (metrics, checksums, an elastic run's agreements: objects.py) goes through
`meta_*` and is counted apart from the strategy's own bytes, in `meta`. Traffic that is not a
step's but pays the link as a step's does (an elastic heal: objects.py) is counted in
`books[name]` and recorded in the flight ring under its name.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.distributed as dist

from .flight import CODE as _FLIGHT_CODE
from .flight import level_code
from .handle import Handle
from .handle import failed as _failed
from .handle import sleep_until as _sleep_until
from .handle import work_future as _work_future
from .wire import wire_bytes

# torch 2.13 renamed the flat collectives; the package supports older torch too.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

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
    emulated_s: float = 0.0  # part of busy_s that only the link emulator added
    # What the link model prices these ops at (no queueing, no jitter): the time a healthy
    # emulated link needs for them, which diagnose/slowlink.py sets beside the exposed time.
    modeled_s: float = 0.0

    def __sub__(self, other: "CommStats") -> "CommStats":
        return CommStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def copy(self) -> "CommStats":
        return CommStats(*(getattr(self, f.name) for f in fields(self)))


class _Issued(NamedTuple):
    """An op as issued: what _run's sync and async halves share (never the work itself)."""
    op: str
    wire: int
    meta: bool
    t0: float
    modeled_end: float | None  # with an emulated link
    span: object  # the tracer's span, or None
    eid: int  # its event in the flight recorder (0: none)
    modeled_s: float = 0.0  # the link model's duration of the op (0: no emulated link)
    book: str | None = None  # counted in Comm.books[book], not the steps' counters


class Comm:
    """Counts and times every collective on one process group."""

    def __init__(self, group: dist.ProcessGroup | None = None, link=None, level: str = "cross"):
        self.group, self.level = group, level  # level: "cross" (across replicas; a flat run's), "intra"
        # Optional: a comm.link.LinkModel to emulate a slower network, and a
        # metrics.trace.Tracer to record spans. Without either, an op costs
        # only its timing and counters (see _run).
        self.link = link
        self.tracer = None
        # The flight recorder (comm/flight.py): the worker attaches one to every run.
        # Each op gets a sequence number on this group, equal on every rank for the same
        # collective, so a post-mortem can tell which rank never reached the one others wait in.
        self.flight = None
        self._seqs = itertools.count(1)
        self._level_code = level_code(level)
        self._deadlines = None
        self._in_flight: weakref.WeakSet[Handle] = weakref.WeakSet()  # async ops not yet waited for
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.backend = dist.get_backend(group) if dist.is_initialized() else "none"
        self.stats = CommStats()
        self.by_op: dict[str, CommStats] = {}
        self.meta = CommStats()
        self.books: dict[str, CommStats] = {}  # traffic apart from the steps' (see the docstring)
        self.last_issue_s = 0.0  # perf_counter() of the latest issue (DDP's exposed time)
        self._lock = threading.Lock()
        self._local = threading.local()

    @contextmanager
    def overlapped(self):
        """Ops issued and waited on inside this block (on this thread) run beside
        compute -- e.g. on ACCO's communication thread -- so their waits are not
        exposed time; the compute thread reports its own wait via add_exposed."""
        previous = getattr(self._local, "overlapped", False)
        self._local.overlapped = True
        try:
            yield
        finally:
            self._local.overlapped = previous

    # -- accounting ---------------------------------------------------------
    def snapshot(self) -> CommStats:
        with self._lock:
            return self.stats.copy()

    def add_exposed(self, seconds: float, end: float | None = None) -> None:
        """Count `seconds` this thread waited, ending at perf_counter() `end` (default: now)."""
        self._add(exposed_s=seconds)
        if seconds > 0:  # a wait measured by the caller
            end = time.perf_counter() if end is None else end
            self._trace_wait(end - seconds, end)

    def _add(self, op: str | None = None, wire: int = 0, ops: int = 0,
             busy_s: float = 0.0, exposed_s: float = 0.0, meta: bool = False,
             emulated_s: float = 0.0, modeled_s: float = 0.0, book: str | None = None) -> None:
        if getattr(self._local, "overlapped", False):
            exposed_s = 0.0
        with self._lock:
            targets = [self.meta] if meta else [self.books.setdefault(book, CommStats())] if book else [self.stats]
            if op is not None and not meta and not book:
                targets.append(self.by_op.setdefault(op, CommStats()))
            for s in targets:
                s.wire_bytes += wire
                s.ops += ops
                s.busy_s += busy_s
                s.exposed_s += exposed_s
                s.emulated_s += emulated_s
                s.modeled_s += modeled_s

    def _sync_device(self, tensor: torch.Tensor | None) -> None:
        # NCCL's wait() only orders streams; timing needs the host to wait too.
        if tensor is not None and tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def _run(self, op: str, nbytes: int, launch, result, async_op: bool, meta: bool = False,
             local=None, book: str | None = None):
        """The one lifecycle of every collective: issue, launch, complete.

        Issue: note the time (last_issue_s is DDP's exposed time); with a link,
        queue the op on the emulated NIC for its modeled end; with a tracer,
        open its span. Meta (bookkeeping) ops are traced but not slowed down,
        since a real run would not send them.
        Complete: an op ends at max(real end, modeled end). A sync op blocks
        until then and is exposed for its whole duration; an async op returns a
        Handle whose wait() blocks until then and counts only the blocked part,
        while its busy time is counted when the transport finishes (`done`).
        """
        if not dist.is_initialized():  # a single process without a group: do the op's local effect
            if local is not None:
                local()
            self._add(op, 0, 1, meta=meta, book=book)
            return Handle(self, None, result) if async_op else None
        issued = self._issue(op, nbytes, meta, book)
        if not async_op:
            return self._run_sync(issued, launch, result)
        return self._run_async(issued, launch, result)

    def _issue(self, op: str, nbytes: int, meta: bool, book: str | None = None) -> _Issued:
        """Note the issue time, queue the op on the emulated link, open its trace span (and its
        event in the flight ring: under `book`'s name when it has one)."""
        wire = wire_bytes(op, nbytes, self.world)
        link = None if meta else self.link
        t0 = time.perf_counter()
        self.last_issue_s = t0
        modeled = None if link is None else link.schedule(op, nbytes, self.world, t0)
        modeled_end = None if modeled is None else modeled[1]
        span = None if self.tracer is None else \
            self.tracer.open_comm(book or op, t0, wire, nbytes, meta, *(modeled or (t0, t0)), level=self.level)
        seq = next(self._seqs)
        eid = 0 if self.flight is None else \
            self.flight.open(_FLIGHT_CODE[book or op], t0, seq, nbytes, wire, self._level_code, meta)
        return _Issued(op, wire, meta, t0, modeled_end, span, eid,
                       0.0 if link is None else link.duration(op, nbytes, self.world), book)

    def _run_sync(self, issued: _Issued, launch, result) -> None:
        """Launch, block until max(real end, modeled end), count it all as exposed."""
        op, t0, meta, span = issued.op, issued.t0, issued.meta, issued.span
        try:
            launch(False)
            self._sync_device(result)
        except BaseException:  # a timeout, a lost peer: the recorder keeps where this rank stopped
            if issued.eid:
                self.flight.close(issued.eid, time.perf_counter(), failed=True)
            raise
        real_end = end = time.perf_counter()
        if issued.modeled_end is not None:  # the emulated link is slower than the real one
            _sleep_until(issued.modeled_end)
            end = time.perf_counter()
        self._add(op, issued.wire, 1, busy_s=end - t0, exposed_s=end - t0, meta=meta,
                  emulated_s=end - real_end, modeled_s=issued.modeled_s, book=issued.book)
        if issued.eid:
            self.flight.close(issued.eid, end)
        if span is not None:
            self.tracer.close_comm(span, real_end, end)
            self._trace_wait(t0, end)

    def _run_async(self, issued: _Issued, launch, result) -> Handle:
        """Launch and return a Handle; busy time is counted when the transport finishes."""
        work = launch(True)
        self._add(issued.op, issued.wire, 1, meta=issued.meta, modeled_s=issued.modeled_s, book=issued.book)
        handle = Handle(self, work, result, issued.modeled_end)
        self._in_flight.add(handle)
        real_future = _work_future(work)
        out_future = None
        if issued.modeled_end is not None and real_future is not None:
            # DDP's reducer (and any .then chain) waits on this future, so it,
            # not gloo's, must complete at the modeled end.
            devices = [result.device] if result is not None and result.is_cuda else None
            out_future = handle._future = torch.futures.Future(devices=devices)
        done = self._on_done(issued, result, out_future)
        if real_future is None:
            handle._on_wait = done  # its busy time ends when wait() returns
        else:
            real_future.add_done_callback(done)
        return handle

    def _on_done(self, issued: _Issued, result, out_future):
        """The callback that ends an async op. Built apart from the work and its handle so
        that it cannot hold them: the work's future holds it, and a cycle through a c10d work
        can end up collected on gloo's own thread, whose process group then dies inside
        itself (SIGABRT at exit)."""
        op, t0, meta, span, modeled_end = issued.op, issued.t0, issued.meta, issued.span, issued.modeled_end
        eid, flight, book = issued.eid, self.flight, issued.book

        def done(fut=None):
            real_end = time.perf_counter()
            end = real_end if modeled_end is None or modeled_end < real_end else modeled_end
            self._add(op, busy_s=end - t0, emulated_s=end - real_end, meta=meta, book=book)
            if eid:
                flight.close(eid, end, failed=_failed(fut))
            if span is not None:
                self.tracer.close_comm(span, real_end, end)
            if out_future is not None:
                self._complete_at(out_future, fut, result, end)
        return done

    def _complete_at(self, out_future: torch.futures.Future, real_future: torch.futures.Future,
                     result: torch.Tensor | None, end: float) -> None:
        """Complete `out_future` like the finished `real_future`, but not before
        `end`. Called from the real future's done callback, i.e. on a thread
        torch owns, which must not sleep: later completions go to Deadlines."""
        try:
            real_future.value()
        except Exception as e:  # a failed collective must fail its waiters too
            out_future.set_exception(e)
            return
        ready = None
        if result is not None and result.is_cuda:
            # Recorded here, where the stream already waits on the op; the
            # deadline thread's own stream does not.
            ready = torch.cuda.Event()
            ready.record()

        def finish():
            if ready is not None:
                ready.synchronize()
            out_future.set_result([result])
        if end <= time.perf_counter():
            finish()
        else:
            if self._deadlines is None:
                from .link import Deadlines
                with self._lock:
                    self._deadlines = self._deadlines or Deadlines()
            self._deadlines.at(end, finish)

    def _trace_wait(self, t0: float, t1: float) -> None:
        """A span for time this thread was blocked on the network (exposed time only)."""
        if (self.tracer is None and self.flight is None) or getattr(self._local, "overlapped", False):
            return
        if self.tracer is not None:
            self.tracer.span("wait", "wait", t0, t1, {"level": self.level})
        if self.flight is not None:
            self.flight.span(_FLIGHT_CODE["wait"], t0, t1)

    # -- the end of a run -----------------------------------------------------
    def drain(self) -> None:
        """Wait for every async op issued here that nobody has waited for yet (a closing run's)."""
        for handle in list(self._in_flight):
            handle.wait()

    def close(self) -> None:
        """Let go of the ops: forget the handles, finish the link emulator's last completions
        and join its threads (comm/link.py, Deadlines.close). The Comm stays usable."""
        self._in_flight = weakref.WeakSet()
        deadlines, self._deadlines = self._deadlines, None
        if deadlines is not None:
            deadlines.close()

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
                         lambda a: _reduce_scatter_flat(output, input, op=red,
                                                        group=self.group, async_op=a),
                         output, async_op, local=lambda: output.copy_(input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """output (W * s) <- concatenation of every rank's input (s).
        Bytes (W-1)/W * S with S the gathered size, i.e. (W-1) * s."""
        return self._run("all_gather", _nbytes(output),
                         lambda a: _all_gather_flat(output, input, group=self.group, async_op=a),
                         output, async_op, local=lambda: output.copy_(input))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """From `src`, a rank of this group. Bytes S (pipelined ring)."""
        return self._run("broadcast", _nbytes(tensor),
                         lambda a: dist.broadcast(tensor, group_src=src, group=self.group, async_op=a),
                         tensor, async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        """Equal splits. Bytes (W-1)/W * S with S the send buffer."""
        return self._run("all_to_all", _nbytes(input),
                         lambda a: dist.all_to_all_single(output, input, group=self.group, async_op=a),
                         output, async_op, local=lambda: output.copy_(input))

    # -- bookkeeping (not strategy traffic) ---------------------------------
    def meta_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        red = _REDUCE_OPS[op]
        self._run("all_reduce", _nbytes(tensor),
                  lambda a: dist.all_reduce(tensor, op=red, group=self.group, async_op=a),
                  tensor, False, meta=True)
        return tensor

    def meta_broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place: every rank gets rank `src`'s values (`src` as in broadcast).
        A no-op on one rank."""
        if self.world > 1:
            self._run("broadcast", _nbytes(tensor),
                      lambda a: dist.broadcast(tensor, group_src=src, group=self.group, async_op=a),
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
                      lambda a: _all_gather_flat(out, flat, group=self.group, async_op=a),
                      out, False, meta=True)
        return out.view(self.world, *tensor.shape)

    def barrier(self) -> None:
        if self.world <= 1:
            return
        seq = next(self._seqs)
        eid = 0 if self.flight is None else \
            self.flight.open(_FLIGHT_CODE["barrier"], time.perf_counter(), seq, level=self._level_code, meta=True)
        try:
            dist.barrier(group=self.group)
        except BaseException:
            if eid:
                self.flight.close(eid, time.perf_counter(), failed=True)
            raise
        if eid:
            self.flight.close(eid, time.perf_counter())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

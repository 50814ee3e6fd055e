"""Python objects through a Comm: an elastic run's agreements and its heal, counted like every byte.

torch's `all_gather_object` and `broadcast_object_list` pickle an object into a byte tensor and
send its length, then the bytes, on the raw process group: nothing counts them, the flight ring
does not see them and `--link` does not slow them. These do the same two steps through a Comm's
own collectives, so that:

- `all_gather_object` (small objects: joins, hashes, round steps, a checkpoint directory seen)
  is bookkeeping, as `Comm.meta_all_gather` is: counted in `comm.meta` (the steps' wire bytes,
  which the planner compares with, are untouched), recorded in the flight ring with the
  bookkeeping flag, never slowed by the emulated link (a real run's agreements are a few bytes);
- `broadcast_object(..., book="heal")` moves a whole state (an elastic heal): its length is
  bookkeeping, its bytes a broadcast counted in `comm.books["heal"]` (apart from the steps'),
  recorded in the flight ring as "heal" and paced by the emulated link as a step's broadcast of
  that size is (link.py: one latency + S / bandwidth, S the pickled state's bytes).

The bytes are pickled as torch pickles them (pickle with tensors' own reducers), so what a
receiver unpickles equals what the sender pickled, bit for bit, as with torch's functions.
"""
from __future__ import annotations

import io
import pickle
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .comm import Comm


class Sent(NamedTuple):
    """One object broadcast: its pickled bytes and the seconds this rank spent in the broadcast
    (its length's and its bytes', from the first issue to the end, the link's pacing included)."""
    value: Any
    nbytes: int
    seconds: float


def pickled(obj: Any) -> torch.Tensor:
    """`obj` as a uint8 tensor of its pickle (the bytes a broadcast or gather moves)."""
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def unpickled(t: torch.Tensor) -> Any:
    return pickle.loads(t.cpu().numpy().tobytes())


def _device(comm: Comm) -> torch.device:
    """Where the byte tensors live: NCCL moves only CUDA tensors."""
    return torch.device("cuda", torch.cuda.current_device()) if comm.backend == "nccl" else torch.device("cpu")


def all_gather_object(comm: Comm, obj: Any) -> list:
    """Every rank's `obj` (small and picklable), in rank order: what torch's all_gather_object
    fills its list with, through `comm`'s bookkeeping gathers (the length, then the bytes padded
    to the longest). One rank, or no process group: [obj]."""
    if comm.world == 1 or not dist.is_initialized():
        return [obj]
    mine, device = pickled(obj), _device(comm)
    lengths = comm.meta_all_gather(torch.tensor([mine.numel()], dtype=torch.int64, device=device)).reshape(-1)
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8, device=device)
    padded[:mine.numel()] = mine.to(device)
    every = comm.meta_all_gather(padded)
    return [unpickled(every[r, :int(n)]) for r, n in enumerate(lengths.tolist())]


def broadcast_object(comm: Comm, obj: Any, src: int, book: str | None = None) -> Sent:
    """Rank `src`'s `obj` (a rank of comm's group; the others pass anything, e.g. None) on every
    rank. Without `book` the bytes are bookkeeping (comm.meta, not paced); with it they are a
    broadcast counted in comm.books[book], recorded under that name and paced by the link. On
    `src` the value is `obj` itself, as with torch's broadcast_object_list."""
    t0 = time.perf_counter()
    if comm.world == 1 or not dist.is_initialized():
        return Sent(obj, 0, 0.0)
    device = _device(comm)
    mine = pickled(obj).to(device) if comm.rank == src else None
    length = comm.meta_broadcast(torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64,
                                              device=device), src=src)
    n = int(length)
    data = mine if mine is not None else torch.empty(n, dtype=torch.uint8, device=device)
    comm._run("broadcast", n, lambda a: dist.broadcast(data, group_src=src, group=comm.group, async_op=a),
              data, False, meta=book is None, book=book)
    value = obj if comm.rank == src else unpickled(data)
    return Sent(value, n, time.perf_counter() - t0)

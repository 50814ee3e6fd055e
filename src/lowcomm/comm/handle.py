"""Handle: an in-flight collective of a Comm (comm.py), and what it asks of c10d's works."""
from __future__ import annotations

import time

import torch


class Handle:
    """An in-flight collective. `wait()` blocks until it is done, counts the
    blocked time as exposed, and returns the op's result tensor."""

    def __init__(self, comm: "Comm", work, result: torch.Tensor | None,
                 modeled_end: float | None = None):
        self._comm = comm
        self._work = work
        self.result = result
        self._waited = False
        self.modeled_end = modeled_end  # set when a link is emulated
        self._future: torch.futures.Future | None = None  # completes at the modeled end
        self._on_wait = None

    @property
    def future(self) -> torch.futures.Future:
        """A torch Future whose value is a list holding the result, like c10d's."""
        if self._future is not None:
            return self._future
        fut = None if self._work is None else work_future(self._work)
        if fut is None:
            # No process group (the op ran locally), or a work without a future
            # (see _work_future): complete one when the op is done (this blocks).
            if self._work is not None:
                self.wait()
            fut = torch.futures.Future()
            fut.set_result([self.result])
        return fut

    def is_completed(self) -> bool:
        if self._waited:
            return True
        if self.modeled_end is not None and time.perf_counter() < self.modeled_end:
            return False
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor | None:
        if not self._waited:
            t0 = time.perf_counter()
            if self._work is not None:
                self._work.wait()
                self._comm._sync_device(self.result)
            if self._on_wait is not None:
                self._on_wait()
            if self.modeled_end is not None:  # the emulated link is slower than the real one
                sleep_until(self.modeled_end)
            t1 = time.perf_counter()
            self._comm._add(exposed_s=t1 - t0)
            self._comm._trace_wait(t0, t1)
            self._waited = True
            self._work = None  # done: the work (and the tensors it holds) is not kept past its wait
            self._comm._in_flight.discard(self)
        return self.result


def work_future(work) -> torch.futures.Future | None:
    """A c10d work's future, or None where it has none: gloo's reduce_scatter
    is composed in Python and its Work has no future, so such an op is only
    seen to end when its wait() returns."""
    try:
        return work.get_future()
    except RuntimeError:
        return None


def failed(fut) -> bool:
    """Whether a completed c10d future holds an error (a timed-out or broken collective)."""
    if fut is None:
        return False
    try:
        fut.value()
    except Exception:
        return True
    return False


def sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)

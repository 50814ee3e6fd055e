"""The launcher of an elastic run: the lighthouse, the store, one process per worker slot
(with --replicas R, K = W/R processes a slot: one replica, replica_run.py).

Unlike a plain run (supervise.run_workers), a worker that dies does not stop the others: the
survivors re-form without it (loop.py), and the launcher restarts the dead slot while
--max-restarts allows, as a joiner. The run ends when the workers finish; a worker still waiting
to join then is stopped, and said. Fewer live workers than --min-workers with no restart left (or
no quorum for --quorum-timeout): every worker is stopped and the run fails in one line, every
slot's flight ring written to OUT/flight as a plain run's.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..errors import RunError
from . import supervise
from ..elastic import lighthouse, support
from ..elastic.address import UsedLighthouse, lighthouse_status
from .join import publish, unpublish

FINISH_GRACE_S = 10.0  # after the first worker finishes, the rest may take this long
LIGHTHOUSE_PROBE_S = 2.0  # the run is failing: a lighthouse that does not answer its status page in this is lost


def launch_elastic(cfg, out: Path | None, quiet: bool) -> None:
    server = UsedLighthouse(cfg.lighthouse) if cfg.lighthouse else lighthouse.start(support.min_workers(cfg))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    from .launcher import flight_rings
    with flight_rings() as rings:  # one a slot
        try:
            publish(out, server.address(), store.port)  # where `lowcomm join` finds the run
            Slots(cfg, store.port, server.address(), out, quiet).run()
        except RunError as e:
            record_flight(e, rings, cfg, out)
            raise
        finally:
            unpublish(out)
            server.shutdown()
            del store


def record_flight(error: RunError, rings: str, cfg, out: Path | None) -> None:
    """Every slot's flight ring to OUT/flight/, and the error's line pointing there. No stall line
    at its head, unlike a plain run's: a slot's ring spans several quorums' groups, whose
    collectives are numbered apart, so which member held up which collective is not read from them."""
    from ..diagnose.postmortem import FLIGHT_DIR
    from .launcher import explain_failure
    explain_failure(error, rings, cfg, out, annotate=False)
    if out is not None and (out / FLIGHT_DIR).is_dir():
        error.args = (f"{error} (flight records in {out / FLIGHT_DIR})",)


class Slots:
    """The worker processes, one a slot, restarted as joiners when they die. With --replicas R
    a slot is a replica of K = W/R processes (replicas.py), stopped and restarted together."""

    def __init__(self, cfg, store_port: int, address: str, out: Path | None, quiet: bool):
        self.cfg, self.store_port, self.address, self.out, self.quiet = cfg, store_port, address, out, quiet
        self.slots = cfg.replicas or cfg.workers
        self.live: dict[int, object] = {}      # slot -> its process context
        self.attempts = [0] * self.slots       # launches of each slot so far
        self.restarts = 0
        self.finished = 0
        self.last_failure = ""

    def start(self, slot: int, joining: bool) -> None:
        from ..train.elastic import elastic_entry
        from ..train.replica_run import slot_entry
        os.environ["LOWCOMM_ATTEMPT"] = str(self.attempts[slot])  # test faults fire once per slot launch
        args = (slot, self.cfg, self.store_port, self.address, str(self.out) if self.out else None, self.quiet, joining)
        size = self.cfg.workers // self.slots
        try:
            self.live[slot] = (supervise.start_workers(elastic_entry, args, 1) if size == 1 else
                               supervise.start_workers(slot_entry, (*args, self.attempts[slot]), size))
        finally:
            os.environ.pop("LOWCOMM_ATTEMPT", None)
        self.attempts[slot] += 1

    def run(self) -> None:
        received: list[int] = []
        previous = supervise._catch_signals(received)
        try:
            for slot in range(self.slots):
                self.start(slot, joining=False)
            self._watch(received)
        finally:
            for ctx in self.live.values():
                supervise.stop(ctx.processes)
                for path in ctx.error_files:
                    supervise._unlink(path)
            supervise._restore_signals(previous)

    def _watch(self, received: list[int]) -> None:
        done_at = None
        while self.live:
            if received:
                raise supervise.interrupted([p for ctx in self.live.values() for p in ctx.processes], received,
                                            ask_first=self.cfg.checkpoint_on_signal)
            sentinels = [p.sentinel for ctx in self.live.values() for p in ctx.processes if p.exitcode is None]
            multiprocessing.connection.wait(sentinels, timeout=supervise.POLL_S)
            # Every slot with an ended process, not just those whose sentinel woke the wait: reading
            # `exitcode` reaps a process, so one that died after the wait returned (two deaths at
            # once) is reaped by the next turn's list and left out of its wait; found here by its
            # exit status, it is handled all the same. Each slot once: the first look settles it.
            for slot in self.ended_slots():
                if received:  # a Ctrl-C reaches the workers too: not a death to restart them from
                    break
                self._ended(slot)
            if self.finished and done_at is None:
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > FINISH_GRACE_S:
                self._left_behind()  # stopped by run's finally
                return
            if not self.finished and len(self.live) < support.min_workers(self.cfg):
                raise RunError(self._too_few())
        if not self.finished:
            raise RunError(self.last_failure or "every worker ended without finishing the run")

    def _left_behind(self) -> None:
        """Say which slots the run ended without: a worker the others dropped (frozen past
        --member-timeout, then continued after their last step) or a restarted one still waiting
        to join; each is stopped when the run ends."""
        kind = "worker" if self.cfg.workers == self.slots else "replica"
        for slot in sorted(self.live):
            print(f"lowcomm: {kind} {slot} had not finished {FINISH_GRACE_S:.0f} s after the run did (no longer a "
                  f"member: dropped from the run, or still waiting to join it); stopped it",
                  file=sys.stderr, flush=True)

    def _too_few(self) -> str:
        """Why the run fails below --min-workers: a lighthouse lost for good first (every worker's
        failure follows from it), else the last worker's failure."""
        left = (f"{len(self.live)} live worker(s), fewer than --min-workers {support.min_workers(self.cfg)}, "
                f"and no restart left")
        try:
            lighthouse_status(self.address, timeout_s=LIGHTHOUSE_PROBE_S)
            lost = "the lighthouse" in self.last_failure
        except OSError as e:
            lost, self.last_failure = True, f"{self.last_failure}; it does not answer now: {e}"
        return f"the lighthouse at {self.address} is lost: {left}: {self.last_failure}" if lost else \
            f"{left}: {self.last_failure}"

    def ended_slots(self) -> list[int]:
        """The live slots with a process that has ended (reaped now or by an earlier look)."""
        return [slot for slot, ctx in self.live.items() if any(p.exitcode is not None for p in ctx.processes)]

    def _ended(self, slot: int) -> None:
        """A process of `slot` ended: the slot finished when all of its processes did; one that
        failed stops the rest of its replica, which is restarted as a whole."""
        ctx = self.live[slot]
        codes = [p.exitcode for p in ctx.processes]
        failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
        if failed is None:
            if all(code == 0 for code in codes):
                self.live.pop(slot)
                self.finished += 1
            return
        self.live.pop(slot)
        supervise.stop(ctx.processes)
        p, name = ctx.processes[failed], f"worker {slot}" if len(codes) == 1 else f"replica {slot} (process {failed})"
        tb = supervise._traceback(ctx.error_files[failed])
        what = (supervise._last_line(tb) if tb else f"killed by signal {supervise._signal_name(-p.exitcode)}"
                if p.exitcode < 0 else f"exited with code {p.exitcode}")
        for path in ctx.error_files:
            supervise._unlink(path)
        self.last_failure = f"{name} failed: {what}"
        if tb and self.out is not None:
            with open(self.out / "error.log", "a") as f:
                f.write(f"--- {name} ---\n{tb}\n")
        if self.finished:
            return
        if tb and supervise.failed_the_run(tb):  # the run failed, not the worker: no restart, no survivor
            raise RunError(what)
        if self.restarts < self.cfg.max_restarts:
            self.restarts += 1
            print(f"lowcomm: {self.last_failure}; the others go on; restarting it "
                  f"({self.restarts} of {self.cfg.max_restarts})", file=sys.stderr, flush=True)
            self.start(slot, joining=True)
        else:
            print(f"lowcomm: {self.last_failure}; the others go on without it", file=sys.stderr, flush=True)

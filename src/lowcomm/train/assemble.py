"""One place assembles a rank's run from the config, for a plain run and for every membership of
an elastic one: its links, its Comm and replica groups, its pace (--slowdown, --stragglers), the
strategy on them, and what watches it (the always-on flight recorder, --trace, the test faults).

A rank is placed by its `Seat`: its rank and world in the group it trains on, and its slot -- the
worker it is for the run's whole life (an elastic member keeps its slot across memberships; in a
plain run it is the rank). Links, pace and faults follow the slot, so a worker keeps its own
emulated link and speed whatever membership it is in; a joiner from `lowcomm join` has a slot
past --workers, with an unshaped pace.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

from .. import config as C
from ..comm import Comm, control
from ..comm.flight import FlightRecorder
from ..comm.groups import ReplicaGroups, ReplicaLayout
from ..diagnose.flight_cost import alternate
from ..diagnose.trace import Tracer
from ..run.build import build as build_run, make_pacer, replica_groups, world_comm
from ..run.driver import RunDriver
from . import faults
from .optim import adamw_factory, lr_schedule


@dataclass(frozen=True)
class Seat:
    rank: int  # in the group this run trains on
    layout: ReplicaLayout  # that group's world, as replicas of processes
    slot: int  # the worker this process is for the run's life: its link seed, pace and test faults

    @property
    def world(self) -> int:
        return self.layout.world


def connect(cfg: C.RunConfig, seat: Seat, flight: FlightRecorder | None,
            before_groups: Callable[[Comm], None] | None = None,
            member_timeout: float | None = None) -> tuple[Comm, ReplicaGroups | None]:
    """This rank's Comm on the whole group and its replica groups (collective: the groups form).
    `before_groups`: a check on the whole group first (torchrun's node numbering); an elastic
    member's groups fail a collective after `member_timeout`, as its quorum's group does."""
    link, intra_link = C.link_factories(cfg)
    comm = world_comm(seat.layout, seat.slot, cfg.seed, link)
    comm.flight = flight
    if before_groups is not None:
        before_groups(comm)
    levels = replica_groups(seat.layout, seat.slot, cfg.seed, link, intra_link)
    if levels is not None and member_timeout is not None:
        shorten_timeouts(levels, member_timeout)
    return comm, levels


def strategy_run(cfg: C.RunConfig, model, comm: Comm, levels: ReplicaGroups | None, seat: Seat,
                 flight: FlightRecorder | None, tracer: Tracer | None, device, options=None,
                 fault_rank: int | None = None) -> RunDriver:
    """The strategy on `levels` (or `comm`), paced as the seat's worker, watched by the flight
    recorder and the tracer. `options`: the strategy's options as the run uses them (an elastic
    run's may differ: elastic/support.py's strategy_options), else the config's. `fault_rank`:
    the rank the test faults name, when not the slot (a process of a torchrun job: its rank there)."""
    factor = cfg.slowdown[seat.slot] if cfg.slowdown and seat.slot < len(cfg.slowdown) else 1.0
    pacer = make_pacer(seat.slot, max(seat.world, cfg.workers), factor, cfg.stragglers, cfg.seed)
    run = build_run(cfg.strategy, model, adamw_factory(cfg.optim), comm, levels, accum=cfg.accum,
                    schedule=lr_schedule(cfg.optim, cfg.steps), total_steps=cfg.steps, pacer=pacer,
                    options=options if options is not None else cfg.strategy_options(),  # validated at launch
                    inside=cfg.inside, precision=cfg.precision)
    for c in run.levels:
        c.flight = flight
    for opt in run.optimizers() if flight is not None else ():
        flight.watch_optimizer(opt)
    if tracer is not None:
        for opt in run.optimizers():
            tracer.watch_optimizer(opt)
        tracer.align(comm, device)
        for c in {id(c): c for c in [comm, *run.levels]}.values():
            c.tracer = tracer
    # test faults by slot; the always-on recorder's benchmark switch
    run = faults.inject(run, seat.slot if fault_rank is None else fault_rank)
    return alternate(run, flight, [comm, *run.levels], cfg.out, seat.rank)


def shorten_timeouts(levels: ReplicaGroups, seconds: float) -> None:
    """The replica groups fail a collective after the member timeout, as the quorum's group does
    (new_group's own timeout is 30 min: a frozen member would hang the others that long)."""
    timeout = timedelta(seconds=seconds)
    from torch.distributed.distributed_c10d import _set_pg_timeout
    for group in (levels.intra.group, levels.cross.group, *control.control_groups()):
        _set_pg_timeout(timeout, group)

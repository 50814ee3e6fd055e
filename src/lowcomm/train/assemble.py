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

import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import config as C
from ..comm import Comm, control
from ..comm.flight import FlightRecorder
from ..comm.groups import ReplicaGroups, ReplicaLayout
from ..diagnose.flight_cost import alternate
from ..diagnose.trace import Tracer
from ..run.build import build as build_run, make_pacer, replica_groups, world_comm
from ..data.loader import StreamBatches
from ..run.driver import RunDriver
from ..models.load import MODEL_DIR
from ..models.save import full_state
from . import faults
from .member_data import load_loader_state, loader_state
from .run_end import write_model
from .optim import adamw_factory, lr_schedule


@dataclass(frozen=True)
class Seat:
    rank: int  # in the group this run trains on
    layout: ReplicaLayout  # that group's world, as replicas of processes
    slot: int  # the worker this process is for the run's life: its link seed, pace and test faults

    @property
    def world(self) -> int:
        return self.layout.world


@dataclass
class Trainer:
    """Everything one rank trains with, built once by `build`."""
    cfg: C.RunConfig
    rank: int
    world: int
    device: torch.device
    backend: str
    comm: Comm
    model: torch.nn.Module
    run: RunDriver
    loader: StreamBatches  # its draws of the run's stream (member_data.py: a plain rank's are its shard's)
    val: list
    source: str
    tracer: Tracer | None
    flight: FlightRecorder | None  # None only when bench/always_on.py measures a run without it
    mem_before: int = 0  # peak memory before the model was built (the runtime's own: torch, the groups)
    step: int = 0  # trainer steps done
    wall_before: float = 0.0  # wall seconds of the run's earlier parts (a resumed run)
    # seconds next_batch spent reading each step's batches (step -> s), until steps.jsonl takes them
    loader_s: dict = field(default_factory=dict)

    def next_batch(self):
        """The next micro-batch on the device; its reading time is the current step's loader_s."""
        start = time.perf_counter()
        x, y = self.loader.next()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        step = self.step + 1  # the step being trained (self.step counts those done)
        self.loader_s[step] = self.loader_s.get(step, 0.0) + time.perf_counter() - start
        return x, y

    def state_dict(self) -> dict:
        """The whole trainer-level state at a step boundary: the strategy's (parameters,
        optimizer, buffers), the data loader's reading position and the RNG states."""
        return {"step": self.step, "strategy": self.run.state_dict(),
                "loader": loader_state(self.loader), "rng": _rng_state(self.device)}

    def write_model_into(self, parent: Path | None) -> None:
        """`parent`/model/: the model this step evaluates (the strategy's evaluated parameters:
        DiLoCo's global θ, ACCO's real θ) in a run's final-model form (models/save.py), so that a
        checkpoint is a model to --init-from and to sample, as a Hugging Face Trainer's
        checkpoint-N is. Collective (the evaluated parameters may be gathered): every rank calls
        it, the rank given `parent` writes."""
        with self.run.evaluating() as model:
            state = full_state(model, keep=parent is not None)  # copied: the training tensors go back
        if parent is not None:
            write_model(self, model, state, Path(parent) / MODEL_DIR)

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]
        self.run.load_state_dict(sd["strategy"])
        load_loader_state(self.loader, sd["loader"])
        _set_rng_state(sd["rng"], self.device)


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def build_trainer(cfg: C.RunConfig, seat: Seat, device: torch.device, backend: str, model: Callable[[], nn.Module],
                  data: Callable[[], tuple], flight: FlightRecorder | None, tracer: Tracer | None, *,
                  check: Callable | None = None, before_groups: Callable[[Comm], None] | None = None,
                  member_timeout: float | None = None, options=None, fault_rank: int | None = None,
                  mem_before: int = 0) -> Trainer:
    """The one assembly of a rank's Trainer, for a plain run and for each membership of an elastic
    one: its Comm and replica groups (`connect`), then its model (`model()`: a plain run builds
    θ0 here; an elastic member brings the one it keeps), `check(model, comm)` (a plain run's
    agreement on θ0), its data (`data()`: loader, validation batches, source label) and the
    strategy on the groups (`strategy_run`)."""
    comm, levels = connect(cfg, seat, flight, before_groups=before_groups, member_timeout=member_timeout)
    net = model()
    if check is not None:
        check(net, comm)
    loader, val, source = data()
    run = strategy_run(cfg, net, comm, levels, seat, flight, tracer, device, options=options, fault_rank=fault_rank)
    return Trainer(cfg, seat.rank, seat.world, device, backend, comm, net, run, loader, val, source, tracer, flight,
                   mem_before=mem_before)


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

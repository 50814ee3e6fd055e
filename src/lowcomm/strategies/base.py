"""The Strategy interface, its StepResult, and the registry by name.

A strategy owns one optimizer step end to end: it pulls micro-batches from
`next_batch()` as it needs them (ACCO and DPU decide *when* gradients are
computed relative to communication, so the strategy drives, not the
trainer), runs `loss_fn(model, batch)`, communicates through `Comm`, and
returns what happened as a StepResult. The trainer loop is then the same few
lines for every strategy, and any `nn.Module` plus loss function works.
"""
from __future__ import annotations

import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ..comm import Comm, CommStats

MakeOptimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
Schedule = Callable[[int], float]  # optimizer step (0-based) -> learning rate
LossFn = Callable[[nn.Module, Any], torch.Tensor]
NextBatch = Callable[[], Any]


@dataclass
class StepResult:
    loss: float            # mean loss of this rank's micro-batches
    micro_batches: int     # micro-batches this rank computed
    tokens: int            # tokens this rank consumed
    wire_bytes: int        # ring-model bytes this rank sent
    compute_s: float       # forward/backward time
    comm_s: float          # time collectives were in flight (overlapped or not)
    exposed_comm_s: float  # time this rank waited on the network
    wall_s: float
    lr: float


def batch_tokens(batch: Any) -> int:
    """Tokens in a micro-batch: the input tensor's element count."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return first.numel() if isinstance(first, torch.Tensor) else 0


class Strategy:
    """One optimizer step of data-parallel training. Subclasses implement `step`."""

    name = ""
    pacer: "Pacer | None" = None  # emulated slow/straggling worker (set by the trainer)

    def __init__(self, model: nn.Module, comm: Comm, make_optimizer: MakeOptimizer,
                 accum: int = 1, schedule: Schedule | None = None):
        if accum < 1:
            raise ValueError(f"accum must be at least 1, got {accum}")
        self.model, self.comm, self.accum = model, comm, accum
        self.make_optimizer, self.schedule = make_optimizer, schedule
        self.steps_done = 0

    # -- the interface ------------------------------------------------------
    def step(self, next_batch: NextBatch, loss_fn: LossFn) -> StepResult:
        raise NotImplementedError

    def eval_model(self) -> nn.Module:
        """The parameters to evaluate (the plain model for synchronous strategies)."""
        return self.model

    @contextmanager
    def evaluating(self):
        """`with strategy.evaluating() as model:` -- the model holding the parameters
        to evaluate, for strategies that must swap them in (and back out) first."""
        yield self.eval_model()

    def report(self) -> dict:
        """Strategy-specific fields for summary.json."""
        return {}

    def close(self) -> None:
        """Release threads and buffers the strategy holds (ACCO's communication thread)."""

    def optimizer_state_bytes(self) -> int:
        return sum(_tensor_bytes(opt.state) for opt in self.optimizers())

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def state_dict(self) -> dict:
        return {"steps_done": self.steps_done,
                "optimizers": [opt.state_dict() for opt in self.optimizers()]}

    def load_state_dict(self, sd: dict) -> None:
        self.steps_done = sd["steps_done"]
        for opt, osd in zip(self.optimizers(), sd["optimizers"]):
            opt.load_state_dict(osd)

    # -- shared pieces --------------------------------------------------------
    def lr_for_step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Apply the schedule (if any) to every param group; return the lr used."""
        if self.schedule is not None:
            lr = self.schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
        return float(optimizer.param_groups[0]["lr"])

    def forward_backward(self, model: nn.Module, next_batch: NextBatch, loss_fn: LossFn,
                         tally: "Tally", scale: float, context=None, pace: bool = True) -> None:
        """One micro-batch: loss * scale backpropagated into the model's grads.
        With a pacer, the emulated slowdown is slept here (pace=False: the
        caller pays it itself, e.g. DDP's comm hook before issuing a bucket)."""
        batch = next_batch()
        t0 = time.perf_counter()
        if self.pacer is not None:
            self.pacer.start(t0)
        with context if context is not None else nullcontext():
            loss = loss_fn(model, batch)
            (loss * scale).backward()
        if loss.is_cuda:  # kernels run asynchronously: time the work, not its launch
            torch.cuda.current_stream(loss.device).synchronize()
        if self.pacer is not None and pace:
            self.pacer.pay(self.steps_done, self.comm.tracer)
        t1 = time.perf_counter()
        # The slowdown emulates a slower device, so its sleep counts as compute.
        tally.compute_s += t1 - t0
        if self.comm.tracer is not None:
            self.comm.tracer.span("micro-batch", "compute", t0, t1)
        tally.loss_sum += float(loss.detach())
        tally.micro_batches += 1
        tally.tokens += batch_tokens(batch)

    def begin(self) -> "Tally":
        return Tally(time.perf_counter(), self.comm.snapshot())

    def finish(self, tally: "Tally", lr: float) -> StepResult:
        spent: CommStats = self.comm.snapshot() - tally.comm_before
        self.steps_done += 1
        return StepResult(
            loss=tally.loss_sum / max(tally.micro_batches, 1),
            micro_batches=tally.micro_batches,
            tokens=tally.tokens,
            wire_bytes=spent.wire_bytes,
            compute_s=tally.compute_s,
            comm_s=spent.busy_s,
            exposed_comm_s=spent.exposed_s,
            wall_s=time.perf_counter() - tally.t0,
            lr=lr,
        )


class Pacer:
    """Makes this rank an emulated slower device: after compute that took c
    seconds it sleeps (f - 1) * c, f = its slowdown factor, times a straggler
    factor F on the steps where this rank is the straggler. Whether and which
    rank straggles is drawn from (seed, step) alone, so every rank agrees
    without communicating."""

    def __init__(self, rank: int, world: int, slowdown: float = 1.0,
                 straggler_prob: float = 0.0, straggler_factor: float = 1.0, seed: int = 0):
        self.rank, self.world, self.slowdown = rank, world, slowdown
        self.straggler_prob, self.straggler_factor, self.seed = straggler_prob, straggler_factor, seed
        self.slept_s = 0.0
        self._mark = time.perf_counter()

    def straggler(self, step: int) -> int | None:
        """The rank that straggles at `step`, or None."""
        if self.straggler_prob <= 0:
            return None
        rng = random.Random(self.seed * 1_000_003 + step)
        return rng.randrange(self.world) if rng.random() < self.straggler_prob else None

    def factor(self, step: int) -> float:
        f = self.slowdown
        return f * self.straggler_factor if self.straggler(step) == self.rank else f

    def start(self, t: float | None = None) -> None:
        self._mark = time.perf_counter() if t is None else t

    def pay(self, step: int, tracer=None) -> float:
        """Sleep for the compute since start() (or the last pay) at this step's factor."""
        now = time.perf_counter()
        extra = (self.factor(step) - 1.0) * (now - self._mark)
        if extra > 0:
            time.sleep(extra)
            end = time.perf_counter()
            self.slept_s += end - now
            if tracer is not None:
                tracer.span("slowdown", "compute.slowdown", now, end)
        self._mark = time.perf_counter()
        return max(extra, 0.0)


@dataclass
class Tally:
    """Running totals of one step, filled by forward_backward and the strategy."""
    t0: float
    comm_before: CommStats
    loss_sum: float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    compute_s: float = 0.0


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# -- registry ----------------------------------------------------------------
_REGISTRY: dict[str, type[Strategy]] = {}


def register(name: str):
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def available() -> list[str]:
    return sorted(_REGISTRY)


def make_strategy(name: str, model: nn.Module, comm: Comm, make_optimizer: MakeOptimizer,
                  accum: int = 1, schedule: Schedule | None = None, **options) -> Strategy:
    """Build a registered strategy by name. `options` are strategy-specific
    (e.g. bucket_mb for ddp)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy '{name}' (choose from: {', '.join(available())})")
    return _REGISTRY[name](model, comm, make_optimizer, accum=accum, schedule=schedule, **options)

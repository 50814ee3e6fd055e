"""The run driver: the one loop every strategy is driven by, and the one place a run is assembled.

    run = make_run("acco", model, Comm(), make_optimizer, accum=4, total_steps=1000)
    result = run.step(next_batch, loss_fn)      # pull-style: the trainer's loop
    result = run.backward(loss)                 # push-style: a user's loop (lowcomm.wrap); None mid-step
    with run.evaluating() as model: ...         # the parameters to evaluate
    run.close()                                 # collective: the same final parameters on every rank

Both the CLI's workers and `lowcomm.wrap()` build a run through `make_run`, so the link
emulator, the device pacer and the run's length reach a strategy the same way. The
driver times each micro-batch from its forward (a pre-hook on the module the user
calls), tallies losses and tokens in a `StepContext`, pays the emulated slowdown,
refuses what must happen between steps while a step is in progress, assembles the
state, and is the one place where the run's communication group may be replaced
between steps (`use_comm`).
"""
from __future__ import annotations

import math
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.nn as nn

from ..comm import Comm, CommStats
from ..comm.control import agree_max, control_group
from ..comm.groups import by_level, total
from ..comm.pacer import Pacer
from ..errors import UsageError
from ..comm.flight import CODE as FLIGHT_CODE
from ..contract.base import MakeOptimizer, Strategy
from ..contract.context import Schedule, StepContext, StepResult, batch_tokens
from ..engines.inside import make_inside
from ..contract.options import build_options
from ..contract.parts import load_parts, replicated_only, save_parts
from ..robust.emulation import data_attack, refuse_own_loss, worker_of
from ..strategies.registry import get, resolve
from . import teardown
from .precision import Precision, make_precision

LossFn = Callable[[nn.Module, Any], torch.Tensor]
NextBatch = Callable[[], Any]


def make_run(strategy: str, model: nn.Module, comm: Comm, make_optimizer: MakeOptimizer, *, accum: int = 1,
             schedule: Schedule | None = None, total_steps: int | None = None, pacer: Pacer | None = None,
             options=None, replica: Comm | None = None, inside: str = "ddp", precision: str | Precision = "fp32",
             **option_values) -> "RunDriver":
    """Build strategy `strategy` on `model` and drive it. `options` is a validated Options
    instance (the CLI's), or give its fields as keywords (e.g. max_accum=8); defaults equal the CLI's.
    Replica groups (comm/groups.py): `comm` is the group across replicas, `replica` the group
    inside this rank's replica, where `inside` runs (engines/inside.py); None: a flat run.
    `precision`: fp32, bf16 or fp16 (CUDA), or a Precision (run/precision.py)."""
    if options is None:
        options = build_options(get(strategy).Options, option_values, strategy)
    elif option_values:
        raise UsageError(f"give strategy options either as options= or as keywords, not both ({sorted(option_values)})")
    strategy, options = resolve(strategy, options)  # an older spelling runs the strategy now named for it
    engine = make_inside(inside, replica)
    precision = make_precision(precision, model, engine.name if engine is not None else None)  # refused first
    cls = get(strategy) if engine is None else engine.strategy_class(get(strategy))  # fsdp's ddp is HSDP
    if engine is not None:  # the user's param groups onto the part a rank runs on (fsdp: its shards)
        make_optimizer = engine.optimizer_factory(make_optimizer)
    return RunDriver(cls(model, comm, make_optimizer, accum=accum, schedule=schedule, options=options,
                         total_steps=total_steps, inside=engine), pacer, precision)


def _deprecated(call: Callable, old: str, new: str) -> Callable:
    """`call`, saying once per call site that `old` is deprecated and `new` is what to call."""
    def forward(*args, **kwargs):
        warnings.warn(f"{old} is deprecated: call {new}", DeprecationWarning, stacklevel=2)
        return call(*args, **kwargs)
    return forward


class RunDriver:
    """A strategy driven one micro-batch at a time, by step() or by a user's backward() calls."""

    def __init__(self, strategy: Strategy, pacer: Pacer | None = None, precision: Precision | None = None):
        self.strategy, self.pacer = strategy, pacer
        self.precision = precision if precision is not None else Precision()
        self.precision.attach(strategy.train_model.parameters())  # fp16: the scaler's unscaling hooks
        strategy.pace = self._pace
        self.ctx: StepContext | None = None      # the step in progress (None between steps)
        self.result: StepResult | None = None    # the latest finished step
        self.stepped = False                     # did the latest backward() finish one?
        self.skipped_steps = 0                   # steps not applied (a non-finite loss or gradient)
        self._compute_t0: float | None = None
        self._forward_tokens = 0
        self._last_loss = None                   # weakref to the latest loss backpropagated
        self._evaluating = self._closed = False
        self._own_groups: list = []              # groups this run made, destroyed by close()
        self.slots: tuple[int, ...] | None = None  # --elastic: each rank's slot (elastic/support.configure)
        self._hook = strategy.train_model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        # lowcomm 0.1's strategy was its own driver: `run.strategy.close()` works, and says what to call now
        strategy.evaluating = _deprecated(self.evaluating, "run.strategy.evaluating()", "run.evaluating()")
        strategy.close = _deprecated(self.close, "run.strategy.close()", "run.close()")
        if strategy.comm.world > 1:
            control_group(strategy.comm.group)  # made now, while nothing is in flight (see close)

    # -- what a user's loop sees ----------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The module to run the training forward on (for ddp the DistributedDataParallel
        wrapper: reach your own attributes through `run.model.module`)."""
        return self.strategy.train_model

    train_model = model

    @property
    def comm(self) -> Comm:
        return self.strategy.comm

    @property
    def options(self):
        return self.strategy.options

    @property
    def levels(self) -> list[Comm]:
        """The run's groups: across replicas (a flat run's only one), then inside this rank's replica."""
        inside = self.strategy.inside
        return [self.comm] if inside is None else [self.comm, inside.comm]

    # -- where this rank is, for the user's data sharding (HSDP's, torchft's layout) ----------
    @property
    def replicas(self) -> int:
        """R: the replicas the strategy runs across (a flat run: the world size)."""
        return self.comm.world

    @property
    def replica_rank(self) -> int:
        """Which replica this rank is in, 0 .. R−1 (a flat run: the rank)."""
        return self.comm.rank

    @property
    def replica_size(self) -> int:
        """K: ranks in each replica (a flat run: 1)."""
        inside = self.strategy.inside
        return 1 if inside is None else inside.comm.world

    @property
    def rank_in_replica(self) -> int:
        """This rank's position in its replica, 0 .. K−1 (a flat run: 0). The global rank is
        replica_rank · replica_size + rank_in_replica."""
        inside = self.strategy.inside
        return 0 if inside is None else inside.comm.rank

    @property
    def steps_done(self) -> int:
        """Trainer steps finished so far, each one optimizer update (acco: its estimate and real rounds)."""
        return self.strategy.steps_done

    steps = steps_done

    @property
    def mid_step(self) -> bool:
        """True while an optimizer step is in progress (micro-batches accumulated, rounds in flight)."""
        return self.ctx is not None

    # -- the loop ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, tokens: int | None = None) -> StepResult | None:
        """Backpropagate one micro-batch's loss; the StepResult when this finished an optimizer
        step (also kept in `result`), else None: keep feeding micro-batches."""
        refuse_own_loss(self.options, worker_of(self.comm.rank, self.slots))  # wrong-data: step() only
        return self._backward(loss, tokens)

    def _backward(self, loss: torch.Tensor, tokens: int | None) -> StepResult | None:
        self._check_open()
        self._check_loss(loss)
        ctx = self._begin()
        t0 = self._compute_t0 if self._compute_t0 is not None else time.perf_counter()
        if self.pacer is not None and self._compute_t0 is None:
            self.pacer.start(t0)
        self._last_loss = weakref.ref(loss)
        self.precision.scale_loss(loss * self.strategy.loss_scale()).backward()
        if loss.is_cuda:  # kernels run asynchronously: time the work, not its launch
            torch.cuda.current_stream(loss.device).synchronize()
        if self.strategy.paces_backward():
            self._pace()
        self._tally(ctx, t0, float(loss.detach()), self._forward_tokens if tokens is None else tokens)
        done = self.strategy.after_backward(ctx)
        self.stepped = done
        return self._finish() if done else None

    def step(self, next_batch: NextBatch, loss_fn: LossFn) -> StepResult:
        """One optimizer step, pulling micro-batches from `next_batch()` as the strategy needs them."""
        self._check_open()
        if self._begin(pull=True).idle:
            return self._finish()
        loss_fn = data_attack(self.options, worker_of(self.comm.rank, self.slots), loss_fn)  # by slot, as Δ's
        while True:
            batch = next_batch()
            self._mark_compute_start()
            with self.autocast():
                loss = loss_fn(self.model, batch)
            result = self._backward(loss, batch_tokens(batch))
            if result is not None:
                return result

    def _begin(self, pull: bool = False) -> StepContext:
        if self.ctx is None:
            if self.comm.flight is not None:  # the step the recorder's events belong to
                self.comm.flight.step = self.strategy.steps_done + 1
            before = by_level(self.levels)
            self.ctx = StepContext(self.strategy.steps_done, time.perf_counter(), total(before.values()),
                                   levels_before=before, pull=pull, optimizer_before=self._optimizer_s())
            self.strategy.begin_step(self.ctx)
        return self.ctx

    def _tally(self, ctx: StepContext, t0: float, loss: float, tokens: int) -> None:
        t1 = time.perf_counter()
        ctx.compute_s += t1 - t0  # the emulated slowdown counts as compute: a slower device's time
        if self.strategy.inside is not None:  # minus waits inside it (fsdp's gathers): exposed comm already
            ctx.compute_s -= self.strategy.inside.take_waited()
        ctx.last_compute_s, ctx.last_compute_end = t1 - t0, t1
        if self.comm.tracer is not None:
            self.comm.tracer.span("micro-batch", "compute", t0, t1)
        if self.comm.flight is not None:
            self.comm.flight.span(FLIGHT_CODE["micro-batch"], t0, t1)
        ctx.loss_sum += loss
        ctx.nonfinite_loss |= not math.isfinite(loss)
        ctx.micro_batches += 1
        ctx.micro += 1
        ctx.tokens += tokens
        self._compute_t0 = None

    def _finish(self) -> StepResult:
        ctx, self.ctx = self.ctx, None
        self.strategy.share_inside()  # across replica groups: the owners' tensors to their replica
        levels = {level: now - ctx.levels_before[level] for level, now in by_level(self.levels).items()}
        spent: CommStats = total(levels.values())  # every level's traffic
        self.strategy.steps_done += 1
        self.skipped_steps += ctx.skipped
        self.precision.after_step(ctx)  # fp16: the step's skip (agreed by the reduction) halves the scale
        self.result = StepResult(
            loss=ctx.idle_loss if ctx.idle else ctx.mean_loss, micro_batches=ctx.micro_batches,
            tokens=ctx.tokens, wire_bytes=spent.wire_bytes, compute_s=ctx.compute_s, comm_s=spent.busy_s,
            exposed_comm_s=spent.exposed_s, wall_s=time.perf_counter() - ctx.t0, lr=ctx.lr, skipped=ctx.skipped,
            link_model_s=spent.modeled_s, optimizer_s=self._optimizer_s() - ctx.optimizer_before, levels=levels)
        return self.result

    def _optimizer_s(self) -> float:
        """The flight recorder's optimizer seconds so far (0 without one)."""
        return self.comm.flight.optimizer_s if self.comm.flight is not None else 0.0

    def _mark_compute_start(self) -> None:
        """A micro-batch's compute starts now (its forward is next)."""
        if self._compute_t0 is None:
            self._compute_t0 = time.perf_counter()
            self._forward_tokens = 0
            if self.pacer is not None:
                self.pacer.start(self._compute_t0)

    def _on_forward(self, module, args, kwargs):
        if self._evaluating or not torch.is_grad_enabled() or self._compute_t0 is not None or self._closed:
            return None
        self._begin()
        self._mark_compute_start()
        self._forward_tokens = batch_tokens(args if args else kwargs)

    def _pace(self) -> None:
        if self.pacer is not None:
            self.pacer.pay(self.strategy.steps_done, self.comm.tracer)

    def _check_loss(self, loss) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError(f"backward() needs a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if self._last_loss is not None and self._last_loss() is loss:
            raise UsageError("backward() was called twice on the same loss; compute a new loss for each micro-batch")
        if not loss.requires_grad:
            raise UsageError("the loss does not require grad: compute it from run.model's output with gradients enabled")

    # -- between steps ----------------------------------------------------------------------
    def _check_safe_point(self, what: str) -> None:
        self._check_open()
        if self.mid_step:
            raise UsageError(f"{what} must be called between optimizer steps, not in the middle of "
                             f"accumulation (wait until a backward returns a step result)")

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"strategy '{self.strategy.name}' was closed")

    def autocast(self):
        """`with run.autocast(): loss = loss_fn(run.model, batch)`: a forward in the run's precision."""
        return self.precision.autocast()

    @contextmanager
    def evaluating(self):
        """`with run.evaluating() as model:` the model holding the parameters to evaluate,
        swapped in (and back out) where needed. Only between optimizer steps."""
        self._check_safe_point("evaluating()")
        self._evaluating = True
        try:
            with self.strategy.swapped_for_eval() as model:
                self.strategy.share_inside(counted=False)  # the owners' evaluated tensors, replica-wide
                yield model
            self.strategy.share_inside(counted=False)  # and the training tensors back
        finally:
            self._evaluating = False

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: the step count, the strategy's state
        parts as it declares them (contract/parts.py) and the loss scale. Only between optimizer steps."""
        self._check_safe_point("state_dict()")
        s = self.strategy
        return {"strategy": s.name, "steps_done": s.steps_done, "parts": save_parts(s.state_parts()),
                "precision": self.precision.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self._check_safe_point("load_state_dict()")
        s = self.strategy
        if sd.get("strategy") != s.name:
            raise UsageError(f"state of strategy '{sd.get('strategy')}' cannot be loaded into '{s.name}'")
        if "parts" not in sd:
            raise UsageError("this state was saved by an older lowcomm (no named state parts); it cannot be loaded")
        s.steps_done = sd["steps_done"]
        load_parts(s.state_parts(), sd["parts"])
        self.precision.load_state_dict(sd.get("precision"))  # fp16's loss scale

    def use_comm(self, comm: Comm) -> None:
        """Replace the run's group between steps (a new membership); the strategy re-targets its engines."""
        self._check_safe_point("use_comm()")
        comm.tracer = comm.tracer or self.comm.tracer
        comm.flight = comm.flight or self.comm.flight
        self.strategy.use_comm(comm)

    # -- the end ----------------------------------------------------------------------------
    def close(self) -> None:
        """End the run on every rank alike: the ranks agree on the last round (the most any
        rank started; where rounds run beside compute, inside them: a closed rank serves its
        peers' rounds until all have closed), each completes it and drains what is in flight,
        a step left half accumulated is dropped, and the final parameters are in the model.
        Then the strategy's threads and hooks are released, every collective the run issued
        has been waited for and let go of (release), and the process groups the run made
        itself (`destroys`) are destroyed. Collective; idempotent."""
        if self._closed:
            return
        try:
            self.ctx = None
            s = self.strategy
            if s.end_run(self._agree):
                s.share_inside()  # across replica groups: the final tensors to the whole replica
            for comm in self.levels:
                comm.drain()
        finally:
            self.release()
        teardown.destroy(self._own_groups)
        self._own_groups = []

    def destroys(self, groups: list) -> None:
        """close() destroys `groups`: process groups made for this run alone (wrap()'s replica groups)."""
        self._own_groups = list(groups)

    def _agree(self, value: int) -> int:
        """The most `value` over the ranks, beside any collective still in flight on the run's group."""
        return agree_max(value, self.comm.group) if self.comm.world > 1 else value

    def release(self) -> None:
        """Release threads, hooks and every reference to a collective or a process group, without a
        collective (a failure, a run stopped to be resumed; run/teardown.py: so that gloo's threads end)."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        self.precision.detach()
        self.strategy.release()
        for comm in self.levels:
            comm.close()
        teardown.release_ddp(self.strategy.train_model)
        teardown.unpin_default_group()

    def __enter__(self) -> "RunDriver":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close() if exc_type is None else self.release()  # after an error a peer may be gone: no collective

    def report(self) -> dict:
        """lowcomm 0.1's make_strategy(...).report(): the strategy's report, with a warning."""
        warnings.warn("run.report() is deprecated: call run.strategy.report()", DeprecationWarning, stacklevel=2)
        return self.strategy.report()

    # -- what the trainer reads ---------------------------------------------------------------
    @property
    def state_replicated(self) -> bool:
        """Whether every rank holds the whole state alike (ddp's): a checkpoint stores it once and loads
        it on any number of workers. Not where a rank runs on its part of the model (FSDP inside)."""
        return replicated_only(self.strategy.state_parts()) and not self.strategy.owns_part

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.strategy.optimizers()

    def optimizer_state_bytes(self) -> int:
        return self.strategy.optimizer_state_bytes()

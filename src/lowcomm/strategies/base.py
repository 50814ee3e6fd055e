"""The Strategy interface: a push-style core, the pull-style `step()` over it, StepResult.

The core is driven one micro-batch at a time. Whoever owns the loop (the
user's script through `lowcomm.wrap()`, or `step()` below) runs a forward on
`strategy.train_model` and hands the loss to `strategy.backward(loss)`; the
strategy backpropagates it and then decides, in `after_backward()`, whether to
keep accumulating, start or finish a communication round, swap parameters, or
step the optimizer. ACCO keeps accepting micro-batches while its round is in
flight, so fast workers contribute more. Each strategy implements three hooks:

    begin_step()      before the first micro-batch of an optimizer step
                      (set the lr, zero gradients, start a delayed round)
    after_backward()  a micro-batch's gradients are in; True ends the step
    loss_scale()      what each micro-batch's loss is multiplied by

`step(next_batch, loss_fn)` is the same loop for every strategy: pull a
batch, forward, backward, until the step ends.
"""
from __future__ import annotations

import math
import random
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable

import torch
import torch.nn as nn

from ..comm import Comm, CommStats
from ..errors import UsageError
from .options import Options
from .plan import PlannedOp, StepCost

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
    skipped: bool = False  # the step was not applied: a loss or gradient was not finite (see Strategy.skip_step)


def batch_tokens(batch: Any) -> int:
    """Tokens in a micro-batch: the input tensor's element count; for a dict batch
    the attention mask's ones (padding is not a token), else its input_ids."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        first = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    else:
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return first.numel() if isinstance(first, torch.Tensor) else 0


@dataclass
class Tally:
    """Running totals of the optimizer step in progress."""
    t0: float
    comm_before: CommStats
    lr: float = float("nan")
    loss_sum: float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    last_compute_s: float = 0.0  # the latest micro-batch's compute (DDP's exposed tail)
    last_compute_end: float = 0.0  # perf_counter() when it ended (its trace span's end)
    nonfinite_loss: bool = False  # a micro-batch of this step had a non-finite loss on this rank
    skipped: bool = False


class Strategy:
    """Data-parallel training, one micro-batch at a time. Subclasses set `Options`
    and implement begin_step / after_backward (and comm_plan)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    # Options under which a run depends only on its inputs, not on timing (the
    # contract tests use them for bit-exact comparisons).
    reproducible_options: ClassVar[dict] = {}
    pacer: "Pacer | None" = None  # emulated slow/straggling worker (set by the trainer)
    # True where the whole state_dict() is identical on every rank (ddp): a checkpoint then
    # stores it once and can load it on another number of workers (checkpoint.py).
    checkpoint_replicated: ClassVar[bool] = False
    skipped_steps = 0  # steps not applied because a loss or gradient was not finite

    def __init__(self, model: nn.Module, comm: Comm, make_optimizer: MakeOptimizer,
                 accum: int = 1, schedule: Schedule | None = None, options: Options | None = None):
        if accum < 1:
            raise UsageError(f"accum must be at least 1, got {accum}")
        self.model, self.comm, self.accum = model, comm, accum
        self.make_optimizer, self.schedule = make_optimizer, schedule
        self.options = (options or self.Options()).validate(self.name)
        self.steps_done = 0
        # Micro-batches of the step in progress on this rank: zeroed before begin_step(),
        # counted before each after_backward(). Between steps (where state is saved) it is 0.
        self.micro = 0
        # The run's length in trainer steps when known (the trainer sets it): a strategy
        # with sync periods (DiLoCo) ends a run that stops mid-period with one last sync.
        self.total_steps: int | None = None
        self._tally: Tally | None = None    # the step in progress (None between steps)
        self._compute_t0: float | None = None
        self._last_loss = None              # weakref to the latest loss backpropagated
        self._evaluating = False
        self._hook = None
        self._closed = False

    def _watch_forward(self) -> None:
        """Time a micro-batch from its forward: a pre-hook on the model the user calls."""
        self._hook = self.train_model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    # -- what subclasses implement ---------------------------------------------
    @property
    def train_model(self) -> nn.Module:
        """The module the training forward must call (ddp: the DDP wrapper)."""
        return self.model

    def loss_scale(self) -> float:
        """Each micro-batch's loss is multiplied by this before backward (mean over accum)."""
        return 1.0 / self.accum

    def begin_step(self) -> None:
        """Before the first micro-batch of an optimizer step; sets self._tally.lr."""
        raise NotImplementedError

    def after_backward(self) -> bool:
        """A micro-batch's gradients are in (self.micro of them this step); return True when
        the optimizer step is done."""
        raise NotImplementedError

    @classmethod
    def comm_plan(cls, num_params: int, world: int, options: Options,
                  shapes: list[tuple[int, ...]] | None = None) -> list[PlannedOp]:
        """What one rank sends, per step or per sync period: [PlannedOp(collective, S, every)].
        `shapes` are the trainable parameters' shapes in model.parameters() order, for
        strategies whose traffic depends on more than the count (DeMo's chunks, PowerSGD's
        matrices, Streaming DiLoCo's fragments); the others ignore them."""
        raise NotImplementedError

    @classmethod
    def plan_occurrences(cls, op: PlannedOp, steps: int, options: Options) -> int:
        """How often `op` runs in a run of `steps` trainer steps (transients included)."""
        return op.occurrences(steps)

    # -- what `lowcomm plan` prices (planner.py) --------------------------------
    # Share of one step's compute that this strategy's collectives run behind: 0 means
    # they start after the compute and are exposed in full (zero1, diloco); 1 means a
    # whole step of compute can hide them (acco, dpu). A strategy with a finer schedule
    # (ddp's buckets, streaming_diloco's delayed merge) overrides exposed_comm_s instead.
    comm_overlap: ClassVar[float] = 0.0

    @classmethod
    def exposed_comm_s(cls, plan: list[PlannedOp], cost: StepCost, options: Options) -> float:
        """Modeled seconds per trainer step that a worker waits on the network."""
        comm = sum(cost.price(op.collective, op.nbytes) * cls.plan_rate(op, options, cost.steps) for op in plan)
        return max(0.0, comm - cls.comm_overlap * cost.compute_s)

    @classmethod
    def micro_batches_per_step(cls, cost: StepCost, comm_s: float, options: Options) -> float:
        """Micro-batches a worker computes per trainer step, averaged over the workers:
        `accum`, except where a strategy computes more while it waits (adaptive acco)."""
        return float(cost.accum)

    @classmethod
    def plan_rate(cls, op: PlannedOp, options: Options, steps: int | None = None) -> float:
        """How often `op` runs per trainer step: averaged over a run of `steps` steps, or in
        the steady state (transients such as warm-up steps or a final sync left out)."""
        if steps is not None:
            return cls.plan_occurrences(op, steps, options) / steps
        return (cls.plan_occurrences(op, 2 * _STEADY, options) - cls.plan_occurrences(op, _STEADY, options)) / _STEADY

    @classmethod
    def model_state_bytes(cls, num_params: int, world: int, options: Options) -> int:
        """Bytes per worker of parameters, gradients and optimizer state (activations not
        included). Here: fp32 θ and ∇θ and AdamW's two moments, replicated on every worker."""
        return 16 * num_params

    def extra_state(self) -> dict:
        """Strategy state beyond model, optimizers and step count (buffers, phase flags)."""
        return {}

    def load_extra_state(self, sd: dict) -> None:
        pass

    def eval_model(self) -> nn.Module:
        """The parameters to evaluate (the plain model for synchronous strategies)."""
        return self.model

    def report(self) -> dict:
        """Strategy-specific fields for summary.json."""
        return {}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return []

    def optimizer_state_bytes(self) -> int:
        return sum(_tensor_bytes(opt.state) for opt in self.optimizers())

    # -- the push-style core ---------------------------------------------------
    def backward(self, loss: torch.Tensor, tokens: int | None = None) -> StepResult | None:
        """Backpropagate one micro-batch's loss; return the StepResult when this
        backward finished an optimizer step, else None (keep feeding micro-batches)."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UsageError(f"backward() needs a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if self._last_loss is not None and self._last_loss() is loss:
            raise UsageError("backward() was called twice on the same loss; compute a new loss for each micro-batch")
        if not loss.requires_grad:
            raise UsageError("the loss does not require grad: compute it from run.model's output with gradients enabled")
        self.ensure_step_begun()
        tally = self._tally
        t0 = self._compute_t0 if self._compute_t0 is not None else time.perf_counter()
        if self.pacer is not None and self._compute_t0 is None:
            self.pacer.start(t0)
        self._last_loss = weakref.ref(loss)
        (loss * self.loss_scale()).backward()
        if loss.is_cuda:  # kernels run asynchronously: time the work, not its launch
            torch.cuda.current_stream(loss.device).synchronize()
        if self.pacer is not None and self.paces_backward():
            self.pacer.pay(self.steps_done, self.comm.tracer)
        t1 = time.perf_counter()
        # The slowdown emulates a slower device, so its sleep counts as compute.
        tally.compute_s += t1 - t0
        tally.last_compute_s = t1 - t0
        tally.last_compute_end = t1
        if self.comm.tracer is not None:
            self.comm.tracer.span("micro-batch", "compute", t0, t1)
        value = float(loss.detach())
        tally.loss_sum += value
        tally.nonfinite_loss |= not math.isfinite(value)
        tally.micro_batches += 1
        tally.tokens += self._forward_tokens if tokens is None else tokens
        self._compute_t0 = None
        self.micro += 1
        if not self.after_backward():
            return None
        return self._finish()

    def step(self, next_batch: NextBatch, loss_fn: LossFn) -> StepResult:
        """One optimizer step, pulling micro-batches from `next_batch()` as the strategy needs them."""
        self.ensure_step_begun()
        while True:
            batch = next_batch()
            self.mark_compute_start()
            result = self.backward(loss_fn(self.train_model, batch), tokens=batch_tokens(batch))
            if result is not None:
                return result

    def ensure_step_begun(self) -> None:
        if self._tally is None:
            self._tally = Tally(time.perf_counter(), self.comm.snapshot())
            self.micro = 0
            self.begin_step()

    def mark_compute_start(self) -> None:
        """A micro-batch's compute starts now (its forward is next)."""
        if self._compute_t0 is None:
            self._compute_t0 = time.perf_counter()
            self._forward_tokens = 0
            if self.pacer is not None:
                self.pacer.start(self._compute_t0)

    def _on_forward(self, module, args, kwargs):
        if self._evaluating or not torch.is_grad_enabled() or self._compute_t0 is not None:
            return None
        self.ensure_step_begun()
        self.mark_compute_start()
        self._forward_tokens = batch_tokens(args if args else kwargs)
        return None

    _forward_tokens = 0

    def paces_backward(self) -> bool:
        """Whether backward() pays the emulated slowdown (ddp pays it in its comm hook instead)."""
        return True

    def _finish(self) -> StepResult:
        tally, self._tally = self._tally, None
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
            lr=tally.lr,
            skipped=tally.skipped,
        )

    # -- non-finite steps ----------------------------------------------------------
    # A step whose loss or gradient is not finite on some rank is skipped on every rank,
    # without an extra collective: the rank that sees it fills what it is about to send
    # with NaN (`poison_nonfinite`), the strategy's own reduction carries the NaN to every
    # rank, and each rank checks what it received (`received_finite`) before it applies
    # anything -- all ranks hold the same reduced values, so they agree. Strategies call
    # these two at their reduction; the trainer logs skipped steps and stops after
    # --max-bad-steps in a row.
    def poison_nonfinite(self, *local: torch.Tensor) -> bool:
        """Before sending: True (and `local` filled with NaN) when this rank's loss in this
        step, or a value of `local`, is not finite."""
        bad = self._tally is not None and self._tally.nonfinite_loss
        return fill_nan_if_nonfinite(*local, force=bad)

    def received_finite(self, *received: torch.Tensor) -> bool:
        """After the reduction, before the update: False (and the step marked skipped) when a
        received value is not finite; the caller then applies nothing."""
        if all_finite(*received):
            return True
        self.skip_step()
        return False

    def skip_step(self) -> None:
        """Mark the step in progress as not applied (a strategy whose state saw the bad values
        clears that state here)."""
        self.skipped_steps += 1
        if self._tally is not None:
            self._tally.skipped = True

    # -- between steps -----------------------------------------------------------
    @property
    def mid_step(self) -> bool:
        """True while an optimizer step is in progress (micro-batches accumulated, rounds in flight)."""
        return self._tally is not None

    def _check_safe_point(self, what: str) -> None:
        self._check_open()
        if self.mid_step:
            raise UsageError(f"{what} must be called between optimizer steps, not in the middle of "
                             f"accumulation (wait until a backward returns a step result)")

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"strategy '{self.name}' was closed")

    @contextmanager
    def evaluating(self):
        """`with strategy.evaluating() as model:` -- the model holding the parameters to
        evaluate, swapped in (and back out) where needed. Only between optimizer steps."""
        self._check_safe_point("evaluating()")
        self._evaluating = True
        try:
            with self.swapped_for_eval() as model:
                yield model
        finally:
            self._evaluating = False

    @contextmanager
    def swapped_for_eval(self):
        yield self.eval_model()

    def state_dict(self) -> dict:
        """Everything needed to continue bit-identically: parameters, optimizer state,
        step count and the strategy's own buffers. Only between optimizer steps."""
        self._check_safe_point("state_dict()")
        return {"strategy": self.name, "steps_done": self.steps_done,
                "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizers": [opt.state_dict() for opt in self.optimizers()],
                "extra": self.extra_state()}

    def load_state_dict(self, sd: dict) -> None:
        self._check_safe_point("load_state_dict()")
        if sd.get("strategy") != self.name:
            raise UsageError(f"state of strategy '{sd.get('strategy')}' cannot be loaded into '{self.name}'")
        self.steps_done = sd["steps_done"]
        self.model.load_state_dict(sd["model"])
        for opt, osd in zip(self.optimizers(), sd["optimizers"], strict=True):
            opt.load_state_dict(osd)
        self.load_extra_state(sd["extra"])

    def close(self) -> None:
        """Release the threads and hooks the strategy holds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:
            self._hook.remove()
        self.release()

    def release(self) -> None:
        """Subclasses stop their threads here."""

    # -- shared pieces ---------------------------------------------------------
    def start_from_rank0(self, tensors) -> None:
        """Every rank starts from rank 0's values (a bookkeeping broadcast, as DDP does at
        construction), so a Python-API user who forgot to seed identically still trains one model."""
        for t in tensors:
            self.comm.meta_broadcast(t, src=0)

    def lr_for_step(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Apply the schedule (if any) to every param group; return the lr used."""
        if self.schedule is not None:
            lr = self.schedule(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
        return float(optimizer.param_groups[0]["lr"])


# A steady-state horizon in trainer steps, divisible by every usual period (powers of two, 10^k,
# 500): plan_rate counts occurrences between _STEADY and 2*_STEADY, past any transient.
_STEADY = 2**12 * 10**6


def all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every value of every tensor is finite (one host sync for all of them). A tensor
    is finite exactly when its min and max are (NaN and inf reach both), and aminmax is about
    10x cheaper on CPU than an elementwise isfinite pass; integer tensors are always finite."""
    ends = [m.float() for t in tensors if t is not None and t.numel() and t.is_floating_point()
            for m in torch.aminmax(t)]
    return bool(torch.stack(ends).isfinite().all()) if ends else True


def fill_nan_if_nonfinite(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Fill every tensor with NaN when one of them holds a non-finite value (or `force`); True then."""
    bad = force or not all_finite(*tensors)
    if bad:
        for t in tensors:
            t.fill_(float("nan"))
    return bad


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


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0

"""The contract of a strategy: what its paper changes about a data-parallel step, nothing else.

The run driver (lowcomm/run/driver.py) owns the loop: it times micro-batches, tallies losses
and tokens, pays the emulated slowdown, assembles state, swaps in parameters to
evaluate, and ends a run collectively. A strategy is handed a `StepContext` (ctx) and
implements only the hooks its algorithm needs:

    comm_plan(layout, world, options)  classmethod: what one rank sends (PlannedOp list); required
    cost                   class: its engine's cost model, how the planner prices comm_plan (plan.py)
    update(ctx)            all `accum` micro-batch gradients are in: communicate and apply; required
                           unless after_backward is overridden
    begin_step(ctx)        before a step's first micro-batch (default: the lr schedule into ctx.lr)
    after_backward(ctx)    one micro-batch's gradient is in (ctx.micro so far); True ends the step
                           (default: update(ctx) once ctx.micro reaches accum)
    loss_scale()           what each micro-batch's loss is multiplied by (default 1/accum)
    train_model            property: the module the training forward must call (default: the model)
    optimizers()           the optimizers the lr schedule sets (default: self.optimizer, if it keeps one)
    state_parts()          its state, by name: {name: Part(save, load, kind, joiner)}, extended by
                           subclasses (contract/parts.py; default: the model, replicated)
    swapped_for_eval()     context: the module holding the parameters to evaluate (default: the model)
    end_run(agree)         collective, at close: the run ends. agree(n) is the most n over the ranks:
                           complete the rounds any rank started, drain what is in flight, leave the
                           final parameters in the model; True when that changed them (default:
                           agree(steps_done), nothing to complete, False). Strategies whose rounds run
                           beside compute agree in them (overlap.py); local SGD's final sync (outer_contract.py)
    use_comm(comm)         the run's group was replaced between steps (default: self.comm = comm)
    report()               strategy-specific fields of summary.json (default: none)
    resolve(options)       classmethod, optional: (name, options, note) of the strategy an older
                           spelling runs (quantized --bits 1 is onebit_adam); absent: itself
    release()              stop the threads the strategy holds (default: nothing)
    elastic                class: where its steps are kept under --elastic (contract/elastic.py)

The constructor is called with the model, a Comm, make_optimizer(params), accum, the
schedule (step -> lr), validated options, the run's length (None if unknown) and `inside`.
By then `self.params` holds the trainable parameters and every rank has rank 0's values.

Replica groups (--replicas R of W workers): `comm` is then the group across replicas (the
R ranks at this rank's position) and `self.inside` the engine inside this rank's replica
(engines/inside.py; None in a flat run). A strategy that runs there lists the engines
it works with in `inside_replica` (on its own class: a subclass is a new algorithm and
declares its own); every other strategy is refused at start-up. Such a strategy runs on the
part of the model the engine gives this rank (`inside.part`): with `ddp` inside the tensors
its position owns, with `fsdp` its shard of every tensor; `self.params` holds only those
(`self.replica_params`: all of them), and it calls `self.reduce_inside()` where its
algorithm reads the step's gradients; the driver shares the owners' parameters inside the
replica after every step (fsdp: nothing to share, FSDP gathers them where they are used);
those pieces are in replica.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ClassVar, Iterable

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import UsageError
from ..models.layout import ModelLayout, layout_of, trainable
from .elastic import ElasticRules
from .context import Schedule, StepContext, apply_schedule, tensor_bytes
from .options import Options
from .parts import Part, optimizer_part
from .plan import Cost, PlannedOp
from .replica import ReplicaPart, start_from_rank0

MakeOptimizer = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


class Strategy(ReplicaPart):
    """Data-parallel training, one micro-batch at a time (see the module docstring)."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options
    # Options under which a run depends only on its inputs, not on timing (the contract
    # tests use them for bit-exact comparisons).
    reproducible_options: ClassVar[dict] = {}
    # The engines inside a replica (--inside) this strategy runs across replica groups with;
    # read from the class itself (runs_inside), never inherited.
    inside_replica: ClassVar[tuple[str, ...]] = ()
    # Across replica groups: the strategy runs on the whole tensors its position owns (False:
    # it splits the replica's work itself, as ddp's buckets).
    owns_tensors: ClassVar[bool] = True
    # The CLI's loader cuts each --micro-batch into this many micro-batches (acco computes a
    # step's batch in two halves, one per round), so a step takes --micro-batch x --accum sequences.
    micro_batch_parts: ClassVar[int] = 1
    # How `lowcomm plan` prices comm_plan's collectives: its engine's cost model (contract/plan.py;
    # the engines' own in engines/costs.py, costs_sharded.py, outer_contract.py).
    cost: ClassVar[type[Cost]] = Cost
    # Where its steps are kept under --elastic (contract/elastic.py; its state: state_parts).
    elastic: ClassVar[type[ElasticRules]] = ElasticRules

    def __init__(self, model: nn.Module, comm: Comm, make_optimizer: MakeOptimizer, accum: int = 1,
                 schedule: Schedule | None = None, options: Options | None = None,
                 total_steps: int | None = None, inside=None):
        if accum < 1:
            raise UsageError(f"accum must be at least 1, got {accum}")
        if inside is not None and not self.runs_inside(inside.name):
            raise UsageError(f"strategy '{self.name}' does not run across replica groups with --inside {inside.name}")
        self.inside = inside  # the engine inside this rank's replica (engines/inside.py), None: flat
        self.model, self.comm, self.accum = model, comm, accum
        self.make_optimizer, self.schedule, self.total_steps = make_optimizer, schedule, total_steps
        self.options = options if options is not None else self.Options().validate(self.name)
        self.replica_params = trainable(model)  # every trainable tensor
        if not self.replica_params:
            raise UsageError("the model has no trainable parameters")
        self.steps_done = 0  # optimizer steps finished (the driver counts them)
        self.pace: Callable[[], None] = lambda: None  # the driver's: pay the emulated slowdown so far
        start_from_rank0(self)
        # What this rank runs the strategy on, and its layout: every tensor (flat), or the part
        # the engine inside the replica gives this rank (whole tensors; fsdp: its shard of each).
        if self.owns_part:
            self.params, self.layout = inside.part(model)
            self.replica_params = trainable(model)  # fsdp swaps in its sharded parameters
        else:
            self.params, self.layout = list(self.replica_params), layout_of(model)

    # -- the hooks (see the module docstring) ---------------------------------------
    @classmethod
    def comm_plan(cls, layout: ModelLayout, world: int, options: Options) -> list[PlannedOp]:
        """What one rank sends, per step or per sync period: [PlannedOp(collective, S, every)]."""
        raise NotImplementedError

    def begin_step(self, ctx: StepContext) -> None:
        ctx.lr = self.set_lr(ctx.step)

    def after_backward(self, ctx: StepContext) -> bool:
        if ctx.micro < self.accum:
            return False
        self.update(ctx)
        return True

    def update(self, ctx: StepContext) -> None:
        raise NotImplementedError(f"strategy '{self.name}' implements neither update() nor after_backward()")

    def loss_scale(self) -> float:
        return 1.0 / self.accum

    @property
    def train_model(self) -> nn.Module:
        return self.model

    def optimizers(self) -> list[torch.optim.Optimizer]:
        optimizer = getattr(self, "optimizer", None)  # a strategy that keeps one optimizer, as self.optimizer
        return [optimizer] if optimizer is not None else []

    def state_parts(self) -> dict[str, Part]:
        """The state, by name (contract/parts.py): the model's parameters and buffers, and the
        optimizer a strategy keeps as self.optimizer, replicated."""
        optimizer = getattr(self, "optimizer", None)
        return {"model": Part(lambda: {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                              self.model.load_state_dict),
                **({"optimizer": optimizer_part(optimizer)} if optimizer is not None else {})}

    @contextmanager
    def swapped_for_eval(self):
        yield self.model

    def end_run(self, agree: Callable[[int], int]) -> bool:
        agree(self.steps_done)  # every rank at its close before any ends (nothing in flight to complete)
        return False

    def use_comm(self, comm: Comm) -> None:
        self.comm = comm

    def report(self) -> dict:
        return {}

    def release(self) -> None:
        pass

    def paces_backward(self) -> bool:
        """Whether the driver pays the emulated slowdown after each backward (ddp pays it in
        its comm hook, before each bucket, where a slower device would be late)."""
        return True

    # -- shared pieces -------------------------------------------------------------------
    def set_lr(self, step: int, optimizers: list[torch.optim.Optimizer] | None = None) -> float:
        """The schedule at `step` into every param group (each at its own scale); the run's lr."""
        return apply_schedule(self.optimizers() if optimizers is None else optimizers, self.schedule, step)

    def optimizer_state_bytes(self) -> int:
        return sum(tensor_bytes(opt.state) for opt in self.optimizers())

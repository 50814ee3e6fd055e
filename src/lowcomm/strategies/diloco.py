"""DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1): local inner steps, a rare outer step.

    every worker starts from the global θ
    H inner steps of the inner optimizer (AdamW by default; its state stays local, never sent)
    Δ_r = θ_global − θ_r;   Δ = mean_r Δ_r                       (the only communication)
    θ_global ← outer SGD(θ_global, grad = Δ)   Nesterov momentum 0.9, lr 0.7 (paper defaults)
    every worker resets to θ_global

`--steps` counts inner steps (one trainer step = one inner step of `--accum` micro-batches),
so equal --steps means equal tokens with ddp. When each fragment syncs, when its mean lands
and how the workers restart is the outer-sync engine's schedule (engines/outer_schedule.py,
shared with Streaming DiLoCo and SparseLoCo: synchronous, streaming, one period late with a
warm-up, eager); the plan's price of it and what a joiner receives under --elastic are
outer_contract.py's; the wire beyond the paper (bf16, int8/int4, a compressor SPEC with error
feedback) is outer_wire.py, phases fitted to each worker's speed sync_by_time.py. Evaluation
and the saved model see θ_global.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from ..contract.base import Strategy
from ..contract.context import all_finite
from ..contract.options import option
from ..contract.parts import LOCAL, Part, attributes, optimizer_part
from ..engines.outer_contract import OuterSyncContract, OuterSyncCost
from ..engines.outer_options import OuterSyncOptions
from ..engines.outer_schedule import OuterSchedule
from ..engines.outer_wire import PRECISIONS
from ..engines.token_weights import WEIGHTS
from ..robust import RobustOptions
from .registry import register


@dataclass
class DiLoCoOptions(RobustOptions, OuterSyncOptions):
    """The local-SGD family's options (Streaming DiLoCo and SparseLoCo share the flags); the
    rules between them are the engine's (engines/outer_options.py)."""
    sync_every: int = option(32, "inner steps (trainer steps) between outer syncs, H", min=1)
    outer_lr: float = option(0.7, "outer SGD learning rate", above=0)
    outer_momentum: float = option(0.9, "outer SGD momentum", min=0, max=1)
    outer_nesterov: bool = option(True, "Nesterov momentum in the outer SGD (only when momentum > 0)")
    outer_precision: str = option("fp32", "outer gradients on the wire: fp32, bf16, or int8/int4 "
                                  "(blockwise absmax, all-gathered)", choices=tuple(PRECISIONS))
    sync_by: str = option("steps", "inner phase length: 'steps' (H inner steps) or 'time' (as many as fit "
                          "in a 1x worker's H steps; FedNova averaging)", choices=("steps", "time"))
    outer_compress: str = option("none", "outer gradients through a lowcomm.compress SPEC with error feedback, "
                                 "all-gathered: topk:F|K, chunk:N, bits:B, quant:absmax|stat (e.g. topk:0.02,bits:2)")
    outer_ef_decay: float = option(1.0, "--outer-compress error feedback: e <- decay*e + delta before "
                                   "compressing (1: classic, 0: no error feedback)", min=0, max=1)
    outer_weights: str = option("equal", "outer gradients averaged with equal weights, or weighted by the tokens "
                                "each worker trained since the last sync (Decoupled DiLoCo; --elastic uses tokens)",
                                choices=WEIGHTS)
    outer_delay: int = option(0, "outer steps a sync's mean is applied late: 0 waits for it; 1 reduces period t's "
                              "during period t+1 and applies it at t+1's end (PCCL's async DiLoCo)", min=0, max=1)
    eager: bool = option(False, "with --outer-delay 1: each worker's own pseudo-gradient stands in for its share of "
                         "the mean in flight until that mean lands (Kale et al.'s eager updates)")
    outer_delay_warmup: int = option(0, "with --outer-delay 1: the syncs of the first N trainer steps still wait "
                                     "for their mean (a synchronous start); later ones are a period late", min=0)


@register("diloco")
class DiLoCo(OuterSyncContract, Strategy):  # its plan, its price and --elastic's rules: the engine's
    Options = DiLoCoOptions
    reproducible_options = {"sync_by": "steps"}
    inside_replica = ("ddp", "fsdp")  # the inner phase inside a replica, pseudo-gradients synced across (comm = cross)
    cost = OuterSyncCost  # each fragment's sync behind what the schedule hides it behind; the final one exposed

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inner = self.make_optimizer(self.params)
        self.sync = OuterSchedule(self.params, self.layout, self.comm, self.options, self._outer_sgd, self.model,
                                  self.inside)
        self.outer = self._outer_sgd(self.sync.globals)
        self.inner_steps, self.last_loss = 0, float("nan")

    def _outer_sgd(self, params):
        o = self.options
        return torch.optim.SGD(params, lr=o.outer_lr, momentum=o.outer_momentum,
                               nesterov=o.outer_nesterov and o.outer_momentum > 0)

    def begin_step(self, ctx):
        self.sync.reissue()  # a loaded state's reduction in flight goes out again, on this group
        ctx.lr = self.set_lr(ctx.step, [self.inner])
        # --sync-by time: a slot without an inner step for this rank (pull-style only; syncs still run)
        if ctx.pull and not self.sync.steps_this_slot():
            self._end_of_slot(ctx)
            ctx.end_idle(self.last_loss)  # the rank's latest inner loss, not a fake 0

    def update(self, ctx):
        self.reduce_inside()  # across replica groups: the replica's mean gradient, one inner step
        # Inner steps are local: a non-finite loss or gradient skips this rank's (replica's) inner step only.
        bad = ctx.poison_nonfinite(*(p.grad for p in self.params if p.grad is not None))
        ctx.skip() if bad else self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.inner_steps, self.last_loss = self.inner_steps + 1, ctx.mean_loss
        self.sync.inner_step(time.perf_counter() - ctx.t0, 0 if bad else ctx.tokens)  # a skipped step trained none
        self._end_of_slot(ctx)

    def _end_of_slot(self, ctx) -> None:
        """The end of this trainer step: for each mean that landed, the outer step (the engine
        issues the syncs due, and merges each fragment once its outer step is taken)."""
        t = self.steps_done + 1  # counted from 1
        for i, mean in self.sync.means_at(t, ctx.t0, final=t == self.total_steps):
            self.outer_step(i, mean, ctx)

    def outer_step(self, i: int, delta, ctx=None) -> None:
        """θ_global ← OuterSGD(θ_global, Δ) on fragment i: the same Δ on every rank keeps θ_global alike."""
        if not self.quorate():  # too few trained: θ_global stays, every rank resets to it
            return
        if all_finite(delta):
            self.sync.globals[i].grad = delta
            self.outer.step()
            self.sync.globals[i].grad = None
        elif ctx is not None:
            ctx.skip()

    def _land(self) -> None:
        """Between steps: the means in flight land (one period late: kept for their step)."""
        for i, delta in self.sync.means_landed(self.steps_done + 1):
            self.outer_step(i, delta)

    def finish(self, rounds: int, ctx=None) -> bool:
        """The final sync (at close while one is owed): all end on θ_global."""
        for i, delta in self.sync.final_means() if rounds else ():
            self.outer_step(i, delta, ctx)
        return bool(rounds)

    def use_comm(self, comm) -> None:
        self._land()  # what is in flight lands on the group it was issued on
        super().use_comm(comm)
        self.sync.use_comm(comm)

    def release(self) -> None:
        self.sync.release()  # nothing left unwaited

    @contextmanager
    def swapped_for_eval(self):
        if not self.options.outer_delay:  # delayed: θ_global waits for no mean in flight
            self._land()
        with self.sync.globals_in_model():
            yield self.model

    def optimizers(self):
        stand_in = self.sync.stand_in
        return [self.inner, self.outer] + ([stand_in.outer] if stand_in is not None else [])

    def state_parts(self):
        """θ_global, the outer momentum and the syncs' schedule are replicated (--elastic's commit points
        are the merges); the rest is the worker's own (engines/outer_contract.py), its local θ restarted
        from θ_global on a joiner. A joiner's inner AdamW is its donor's, as torchft's DiLoCo heals the
        inner optimizer: fresh, its first inner steps were sign steps (a full lr on every coordinate),
        each joiner's first pseudo-gradient was inflated into the outer momentum, and a faulted
        streaming_diloco run's training loss drifted above the fault-free run's join by join."""
        model = super().state_parts()["model"]
        # Saved first: a sync in flight lands (its outer step is part of the state); with --outer-delay 1
        # it stays in flight, kept as this rank's part of it and re-issued when the state is loaded.
        return {"landed": Part(self._land_unless_delayed, lambda _: None), **self.sync.state_parts(),
                "model": replace(model, kind=LOCAL, joiner="peer", after_join=self.sync.restart_from_globals),
                "inner": optimizer_part(self.inner, LOCAL, joiner="peer"), "outer": optimizer_part(self.outer),
                **attributes(self, "inner_steps", "last_loss")}

    def _land_unless_delayed(self) -> None:
        if not self.options.outer_delay:
            self._land()

    def report(self) -> dict:
        o = self.options
        return {**self.sync.report(self.steps_done), "inner_steps_rank0": self.inner_steps, "sync_every": o.sync_every,
                "inner_steps_per_step_rank0": self.inner_steps / max(self.steps_done, 1), "sync_by": o.sync_by,
                "outer_precision": o.outer_precision, "outer_compress": o.outer_compress}

"""1-bit Adam (Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He; arXiv 2102.02888),
Algorithm 1, with every byte through Comm:

    warm-up, steps 1..T0:   g <- mean over ranks of the gradient (exact fp32 all-reduce)
                            Adam's own step (it learns its second moment v)
    then, v frozen at T0:   m_w <- β1·m + (1 - β1)·g_w            m: the momentum every rank shares
                            m   <- compressed mean of m_w          1-bit sign, two stages, error feedback
                            θ   <- θ·(1 - lr·wd) - lr/(1 - β1^t) · m / (sqrt(v / (1 - β2^T0)) + eps)

Why v is frozen: sign-compressed gradients fed to Adam corrupt v (error feedback keeps the
*sum* of what is sent right, not the sum of squares); measured here, 1-bit gradients into AdamW
gained nothing from error feedback. With v frozen the update is linear in m, so error feedback
on m is sound. The compressed mean is engines/compressed.py's CompressedAllReduce (quantized sends
gradients through the same engine); Adam's frozen-v step is lowcomm.engines.optim.FrozenAdam, which
keeps m and t in the run's optimizer's state (and so in its checkpoint) and honours each param
group's lr, betas, eps and weight decay.

T0 is --freeze-variance-after; by default a fifth of the run (on the corpus recipe, 300 steps:
60 warm-up steps ended 1.3 % above ddp, 30 ended 3.5 % above). Bytes per step: 2(W-1)/W · 4P in
the warm-up, then 2(W-1)/W · (P/8 + 4P/block) (P padded to W whole blocks).
`lowcomm train --strategy quantized --bits 1` is the older spelling of this strategy.

Under --elastic (contract/elastic.py) θ, Adam's m (shared: every rank steps on the same mean) and
the frozen v are replicated; the worker and server error-feedback residuals are each rank's own,
and a joiner starts them at zero, as DeepSpeed's OnebitAdam resets them whenever it loads a
checkpoint (distinct on every GPU; resetting them did not affect BERT's convergence, DeepSpeed's
code notes). Commit point: every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engines.compressed import compressed_allreduce, payload_bytes
from ..errors import UsageError
from ..engines.optim import FrozenAdam
from ..contract.base import Strategy
from ..contract.options import Options, option
from ..contract.parts import LOCAL, Part, attributes
from ..contract.plan import PlannedOp
from ..contract.replica import splitting_inside
from ..engines.costs import OneBitAdamCost
from .registry import register

# The warm-up when --freeze-variance-after is left at -1: a fifth of the run (see the docstring).
WARMUP_SHARE = 0.2
SETTLED_WARMUP = 10  # fewer default warm-up steps than this: the launch says so (run_note)
BITS = 1


@dataclass
class OneBitAdamOptions(Options):
    block_size: int = option(256, "values per quantization block (one fp32 scale each)", min=1)
    error_feedback: bool = option(True, "keep the compression error and add it to the next step "
                                        "(--no-error-feedback to drop it)")
    freeze_variance_after: int = option(
        -1, "1-bit Adam's warm-up: exact fp32 steps before Adam's second moment is frozen and its momentum "
            "compressed (-1: a fifth of the run); quantized keeps it for the older spelling of onebit_adam: "
            "--bits 1 with -1 or N > 0 runs onebit_adam, with 0 it sends 1-bit gradients", min=-1)

    def check(self):
        if self.freeze_variance_after == 0:
            raise UsageError("--freeze-variance-after (onebit_adam.freeze_variance_after) must be -1 or at least 1, "
                             "got 0: 1-bit Adam learns Adam's variance from exact steps first (1-bit gradients "
                             "without a warm-up: --strategy quantized --bits 1 --freeze-variance-after 0)")

    def warmup_steps(self, total_steps: int | None) -> int:
        """T0: how many first steps all-reduce exactly, in a run of total_steps."""
        if self.freeze_variance_after > 0:
            return self.freeze_variance_after
        if total_steps is None:
            raise UsageError("onebit_adam warms up for a fifth of the run: give the run's length "
                             "(wrap(..., total_steps=N)) or freeze_variance_after=N")
        return max(1, int(total_steps * WARMUP_SHARE))  # Adam needs one v before it freezes

    def run_note(self, cfg) -> str | None:
        """A default warm-up too short for v to settle: said, since the 1-bit steps after it can
        diverge without an error (12-step bench runs, 2 warm-up steps, ended at loss 10.2 from 5.6)."""
        warmup = self.warmup_steps(cfg.steps)
        if self.freeze_variance_after > 0 or warmup >= SETTLED_WARMUP:
            return None
        return (f"onebit_adam warms up for {warmup} exact step(s), a fifth of --steps {cfg.steps}: too few for "
                f"Adam's second moment to settle before it is frozen, and the 1-bit steps after may diverge; "
                f"give --freeze-variance-after N (30 did not diverge on the corpus recipe) or more --steps")


@register("onebit_adam")
class OneBitAdam(Strategy):
    Options = OneBitAdamOptions
    # A warm-up that needs no run length (the contract tests build runs without total_steps)
    # and ends early enough that their few steps cross the freeze.
    reproducible_options = {"freeze_variance_after": 2}
    # across replica groups: each position's blocks (engines/compressed.py's SplitByPosition); fsdp: its shards' blocks
    inside_replica = ("ddp", "fsdp")
    owns_tensors = False
    cost = OneBitAdamCost  # exact warm-up, then the compressed pair after the step; split by position across

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        self.optimizer = make_optimizer(self.params)
        self.adam = FrozenAdam(self.optimizer, self.params)
        self.allreduce = compressed_allreduce(comm, splitting_inside(self), self.params, BITS,
                                              self.options.block_size, self.options.error_feedback)
        self.warmup: int | None = None  # T0, known once the run's length is (first step)

    @classmethod
    def comm_plan(cls, layout, world, options):
        total = payload_bytes(layout.numel, world, BITS, options.block_size)
        return [PlannedOp("all_to_all", total, what="1-bit momentum shards (worker -> owner)"),
                PlannedOp("all_gather", total, what="1-bit summed shards (owner -> all)"),
                PlannedOp("all_reduce", 4 * layout.numel, what="fp32 gradient (1-bit Adam's warm-up)")]

    def use_comm(self, comm):
        self.comm = self.allreduce.comm = comm

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(ctx.step)
        if self.warmup is None:
            self.warmup = self.options.warmup_steps(self.total_steps)

    def update(self, ctx):
        self.reduce_inside()  # fsdp inside: the replica's mean gradient of this rank's shards
        if self.steps_done < self.warmup:
            self._exact_adam_step(ctx)
        else:
            self._compressed_momentum_step(ctx)
        self.optimizer.zero_grad(set_to_none=True)

    def _exact_adam_step(self, ctx) -> None:
        """The warm-up: Adam learns v from exact mean gradients (a plain fp32 all-reduce)."""
        grads = self.allreduce.flat([p.grad for p in self.params])
        self.allreduce.replica_mean(grads)  # across replica groups: the replica's (else nothing)
        grads = self.allreduce.exact_mean(ctx, grads, reduced=True)
        if grads is not None:
            for p, g in zip(self.params, self.allreduce.views(grads)):
                p.grad = g.to(p.dtype).clone()
            self.optimizer.step()

    @torch.no_grad()
    def _compressed_momentum_step(self, ctx) -> None:
        """v frozen: each rank's next momentum goes through the compressed mean, and Adam's
        step applies the mean (the docstring's second phase)."""
        adam = self.adam
        local = self.allreduce.flat([p.grad for p in self.params])
        self.allreduce.replica_mean(local)  # across replica groups: every rank's m_w is its replica's
        for p, g in zip(self.params, self.allreduce.views(local)):
            m = adam.state(p)["exp_avg"]  # in p's dtype; the wire's buffer is fp32
            g.copy_(torch.lerp(m, adam.gradient(p, g).to(m.dtype), 1 - adam.beta1(p)))
        mean = self.allreduce.mean(ctx, local, reduced=True)
        if mean is None:
            return
        for p, m, denominator in zip(self.params, self.allreduce.views(mean), adam.denominators()):
            adam.apply(p, m, denominator)

    def state_parts(self):
        """θ, Adam (replicated); the error feedback, this rank's own (a joiner's is zero); the warm-up's
        length, fixed for the run (a resume with another --steps keeps it)."""
        return {**super().state_parts(), "residuals": Part(self.allreduce.state_dict, self.allreduce.load_state_dict, LOCAL),
                **attributes(self, "warmup"), "adam": Part(self.adam.state_dict, self.adam.load_state_dict)}

    def report(self):
        return {**self.allreduce.report(self.steps_done), "exact_warmup_steps": self.warmup}

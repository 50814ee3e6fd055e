"""Quantized all-reduce with error feedback (two-stage, as in 1-bit Adam):

    G    <- mean of `accum` micro-batch gradients, flattened, padded to W shards of m
    c_j  <- Q(G_j + e1_j) for each shard j;  e1 <- (G + e1) - deq(c)     (worker's EF)
    all_to_all(c): rank r receives every worker's c_r
    s_r  <- (1/W) sum_w deq(c_r from w)                                  (fp32)
    c'_r <- Q(s_r + e2);  e2 <- (s_r + e2) - deq(c'_r)                   (shard owner's EF)
    all_gather(c'): every rank decodes the same mean gradient
    θ    <- opt(θ; gradient)                              (replicated optimizer, like DDP)

Q is int8 / int4 with a per-block absmax scale or 1-bit sign with a per-block scale
(lowcomm.compress). Wire bytes per step: 2 (W-1)/W · W·nbytes(m), i.e. about
2(W-1)/W · P · bits/8 plus 4 bytes per block; the ring shape of DDP's all-reduce.

At 1 bit this is 1-bit Adam (Tang et al., arXiv 2102.02888) by default: sign-compressed
gradients fed to Adam corrupt its second moment v (error feedback keeps the *sum* of what
is sent right, not the sum of squares), and measured here error feedback then did not help
at all. So the first `freeze_variance_after` steps all-reduce the gradient exactly (fp32)
while Adam learns v; then v is frozen, Adam is linear in its momentum, and the momentum
is what goes through the two stages above (see `_onebit_adam_step`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..compress import ErrorFeedback, quantizer_for_bits
from ..optim import FrozenAdam
from ..errors import UsageError
from .base import Strategy
from .context import fill_nan_if_nonfinite
from .options import Options, option
from .plan import PlannedOp
from .registry import register


# 1-bit Adam's warm-up when the option is left to its default: a fifth of the run (300 steps
# of the corpus recipe: 60 warm-up steps gave 1.3 % above ddp, 30 gave 3.5 %).
ONEBIT_WARMUP_SHARE = 0.2


@dataclass
class QuantizedOptions(Options):
    bits: int = option(8, "bits per gradient value on the wire: 8, 4 (int, absmax per block) or 1 (sign)",
                       choices=(8, 4, 1))
    block_size: int = option(256, "values per quantization block (one fp32 scale each)", min=1)
    error_feedback: bool = option(True, "keep the compression error and add it to the next step "
                                        "(--no-error-feedback to drop it)")
    freeze_variance_after: int = option(
        -1, "1-bit Adam: all-reduce gradients exactly (fp32) for the first N steps, then freeze Adam's "
            "second moment and send its compressed momentum; 0: compress gradients from the first step "
            "into the unchanged optimizer; -1: a fifth of the run at 1 bit, 0 at 8 or 4 bits", min=-1)

    @property
    def onebit_adam(self) -> bool:
        """Whether the optimizer's variance is frozen after an exact warm-up (1-bit Adam)."""
        return self.freeze_variance_after > 0 or (self.freeze_variance_after < 0 and self.bits == 1)

    def exact_steps(self, total_steps: int | None) -> int:
        """How many first steps all-reduce exactly (1-bit Adam's warm-up) in a run of total_steps."""
        if not self.onebit_adam:
            return 0
        if self.freeze_variance_after > 0:
            return self.freeze_variance_after
        if total_steps is None:
            raise UsageError("quantized at 1 bit warms up for a fifth of the run: give the run's length "
                             "(wrap(..., total_steps=N)) or freeze_variance_after=N")
        return max(1, int(total_steps * ONEBIT_WARMUP_SHARE))  # Adam needs one v before it freezes


def shard_len(num_params: int, world: int, block: int) -> int:
    """m: each rank's shard of the flat gradient, a whole number of blocks."""
    per = -(-num_params // world)
    return -(-per // block) * block


@register("quantized")
class Quantized(Strategy):
    Options = QuantizedOptions

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        self.numel = sum(p.numel() for p in self.params)
        self.world = comm.world
        self.m = shard_len(self.numel, self.world, self.options.block_size)
        self.q = quantizer_for_bits(self.options.bits, self.options.block_size)
        self.ef = ErrorFeedback(self.q, enabled=self.options.error_feedback)
        self.optimizer = make_optimizer(model.parameters())
        # 1-bit Adam: after the warm-up, the optimizer's variance is frozen and its momentum compressed
        self.adam = FrozenAdam(self.optimizer, self.params) if self.options.onebit_adam else None
        self.warmup: int | None = None  # exact steps, known once the run's length is (first step)
        self.compress_s = 0.0  # CPU time spent compressing and decompressing

    @classmethod
    def comm_plan(cls, layout, world, options):
        num_params = layout.numel
        m = shard_len(num_params, world, options.block_size)
        q = quantizer_for_bits(options.bits, options.block_size)
        total = world * q.nbytes(m)
        sent = "momentum" if options.onebit_adam else "gradient"
        plan = [PlannedOp("all_to_all", total, what=f"{q.name} {sent} shards (worker -> owner)"),
                PlannedOp("all_gather", total, what=f"{q.name} summed shards (owner -> all)")]
        if options.onebit_adam:
            plan.append(PlannedOp("all_reduce", 4 * num_params, what="fp32 gradient (1-bit Adam's warm-up)"))
        return plan

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        """1-bit Adam: the fp32 all-reduce runs in the warm-up steps, the compressed pair after."""
        warm = min(steps, options.exact_steps(steps))
        return warm if op.collective == "all_reduce" else steps - warm

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # replicated AdamW, plus the worker's and the shard owner's error-feedback residuals,
        # plus 1-bit Adam's frozen denominators
        m = shard_len(num_params, world, options.block_size)
        return (16 * num_params + (4 * num_params + 4 * m if options.error_feedback else 0)
                + (4 * num_params if options.onebit_adam else 0))

    def optimizers(self):
        return [self.optimizer]

    def begin_step(self, ctx):
        ctx.lr = self.set_lr(ctx.step)
        if self.warmup is None:
            self.warmup = self.options.exact_steps(self.total_steps)

    def update(self, ctx):
        if self.steps_done < self.warmup:  # 1-bit Adam's warm-up: Adam learns v from exact gradients
            if self._exact_mean_gradient(ctx):
                self.optimizer.step()
        elif self.adam is not None:
            self._onebit_adam_step(ctx)
        elif self._compressed_mean_gradient(ctx):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- what is reduced -------------------------------------------------------------
    def _flat_grad(self) -> torch.Tensor:
        flat = torch.zeros(self.world * self.m, dtype=torch.float32, device=self.params[0].device)
        at = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                flat[at:at + n].copy_(p.grad.reshape(-1))
            at += n
        return flat

    def _set_grads(self, flat: torch.Tensor) -> None:
        at = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[at:at + n].view_as(p).to(p.dtype).clone()
            at += n

    def _exact_mean_gradient(self, ctx) -> bool:
        """1-bit Adam's warm-up: a plain fp32 all-reduce, so Adam's second moment is learnt
        from true gradients before it is frozen."""
        flat = self._flat_grad()[:self.numel]
        ctx.poison_nonfinite(flat)
        self.comm.all_reduce(flat)
        flat /= self.world
        if not ctx.received_finite(flat):
            return False
        self._set_grads(flat)
        return True

    def _compressed_mean_gradient(self, ctx) -> bool:
        """The compressed mean gradient into p.grad; False when it is not finite (skipped)."""
        mean = self._compressed_mean(ctx, self._flat_grad())
        if mean is None:
            return False
        t0 = time.perf_counter()
        self._set_grads(mean)
        self.compress_s += time.perf_counter() - t0
        return True

    @torch.no_grad()
    def _onebit_adam_step(self, ctx) -> None:
        """1-bit Adam's compression stage (Tang et al. 2021, Algorithm 1): with v frozen the
        update is linear in the momentum, so error feedback on the momentum is sound:
            m_w <- β1·m + (1 - β1)·g_w          (m: the momentum every rank shares)
            m   <- the two-stage compressed mean of m_w
            θ   <- θ·(1 - lr·wd) - lr/(1 - β1^t) · m / (sqrt(v / (1 - β2^t0)) + eps)
        t0: the step count at which v froze. m and t stay in the optimizer's own state."""
        adam = self.adam
        local = self._flat_grad()
        at = 0
        for p in self.params:
            n = p.numel()
            g = adam.gradient(p, local[at:at + n].view_as(p))
            local[at:at + n] = torch.lerp(adam.state(p)["exp_avg"], g, 1 - adam.beta1(p)).reshape(-1)
            at += n
        mean = self._compressed_mean(ctx, local)
        if mean is None:
            return
        at = 0
        for p, denominator in zip(self.params, adam.denominators()):
            n = p.numel()
            adam.apply(p, mean[at:at + n].view_as(p), denominator)
            at += n

    def _compress(self, key: str, x: torch.Tensor, bad: bool):
        """With error feedback; a non-finite input (NaN-filled: its scales carry the NaN to every
        rank) is sent without touching the residual, so the skipped step leaves no trace."""
        return self.q.compress(x) if bad else self.ef.compress(key, x)[0]

    def _compressed_mean(self, ctx, flat: torch.Tensor) -> torch.Tensor | None:
        """The two-stage compressed mean of every rank's `flat` (W·m values); None when it is
        not finite (the step is then skipped on every rank)."""
        W, m, q = self.world, self.m, self.q
        nb = q.nbytes(m)
        t0 = time.perf_counter()
        flat = flat.view(W, m)
        payload = self._compress("worker", flat, ctx.poison_nonfinite(flat))  # W rows: one per shard owner
        send = q.to_bytes(payload).reshape(-1)
        recv = torch.empty_like(send)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_to_all(recv, send)

        t0 = time.perf_counter()
        mine = q.decompress(q.from_bytes(recv.view(W, nb), m))  # every worker's copy of my shard
        mean = mine.sum(0) / W
        payload = self._compress("owner", mean, fill_nan_if_nonfinite(mean))
        own = q.to_bytes(payload)
        gathered = torch.empty(W * nb, dtype=torch.uint8, device=own.device)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_gather(gathered, own)

        t0 = time.perf_counter()
        mean = q.decompress(q.from_bytes(gathered.view(W, nb), m)).reshape(-1)
        self.compress_s += time.perf_counter() - t0
        return mean if ctx.received_finite(mean) else None

    def extra_state(self):
        return {"residuals": self.ef.state_dict(), "warmup": self.warmup,
                "adam": self.adam.state_dict() if self.adam is not None else None}

    def load_extra_state(self, sd):
        self.ef.load_state_dict(sd["residuals"])
        self.warmup = sd["warmup"]  # fixed for the run: a resume with another --steps keeps it
        if self.adam is not None:
            self.adam.load_state_dict(sd["adam"])

    def report(self):
        steps = max(self.steps_done, 1)
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / steps,
                "compressor": self.q.name, "error_feedback": self.options.error_feedback,
                "exact_warmup_steps": self.warmup}

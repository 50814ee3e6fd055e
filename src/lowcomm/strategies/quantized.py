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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..compress import ErrorFeedback, quantizer_for_bits
from .base import Strategy, fill_nan_if_nonfinite
from .options import Options, option
from .plan import PlannedOp
from .registry import register


@dataclass
class QuantizedOptions(Options):
    bits: int = option(8, "bits per gradient value on the wire: 8, 4 (int, absmax per block) or 1 (sign)",
                       choices=(8, 4, 1))
    block_size: int = option(256, "values per quantization block (one fp32 scale each)", min=1)
    error_feedback: bool = option(True, "keep the compression error and add it to the next step "
                                        "(--no-error-feedback to drop it)")


def shard_len(num_params: int, world: int, block: int) -> int:
    """m: each rank's shard of the flat gradient, a whole number of blocks."""
    per = -(-num_params // world)
    return -(-per // block) * block


@register("quantized")
class Quantized(Strategy):
    Options = QuantizedOptions

    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, options=None):
        super().__init__(model, comm, make_optimizer, accum, schedule, options)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.start_from_rank0(p.data for p in self.params)
        self.numel = sum(p.numel() for p in self.params)
        self.world = comm.world
        self.m = shard_len(self.numel, self.world, self.options.block_size)
        self.q = quantizer_for_bits(self.options.bits, self.options.block_size)
        self.ef = ErrorFeedback(self.q, enabled=self.options.error_feedback)
        self.optimizer = make_optimizer(model.parameters())
        self.micro = 0
        self.compress_s = 0.0  # CPU time spent compressing and decompressing
        self._watch_forward()

    @classmethod
    def comm_plan(cls, num_params, world, options, shapes=None):
        m = shard_len(num_params, world, options.block_size)
        q = quantizer_for_bits(options.bits, options.block_size)
        total = world * q.nbytes(m)
        return [PlannedOp("all_to_all", total, what=f"{q.name} gradient shards (worker -> owner)"),
                PlannedOp("all_gather", total, what=f"{q.name} summed shards (owner -> all)")]

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # replicated AdamW, plus the worker's and the shard owner's error-feedback residuals
        m = shard_len(num_params, world, options.block_size)
        return 16 * num_params + (4 * num_params + 4 * m if options.error_feedback else 0)

    def optimizers(self):
        return [self.optimizer]

    def begin_step(self):
        self._tally.lr = self.lr_for_step(self.optimizer, self.steps_done)
        self.micro = 0

    def after_backward(self):
        self.micro += 1
        if self.micro < self.accum:
            return False
        if self._reduce_gradients():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _flat_grad(self) -> torch.Tensor:
        flat = torch.zeros(self.world * self.m, dtype=torch.float32, device=self.params[0].device)
        at = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:
                flat[at:at + n].copy_(p.grad.reshape(-1))
            at += n
        return flat

    def _compress(self, key: str, x: torch.Tensor, bad: bool):
        """With error feedback; a non-finite input (NaN-filled: its scales carry the NaN to every
        rank) is sent without touching the residual, so the skipped step leaves no trace."""
        return self.q.compress(x) if bad else self.ef.compress(key, x)[0]

    def _reduce_gradients(self) -> bool:
        """The mean gradient into p.grad; False when it is not finite (the step is skipped)."""
        W, m, q = self.world, self.m, self.q
        nb = q.nbytes(m)
        t0 = time.perf_counter()
        flat = self._flat_grad().view(W, m)
        payload = self._compress("worker", flat, self.poison_nonfinite(flat))  # W rows: one per shard owner
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
        grad = q.decompress(q.from_bytes(gathered.view(W, nb), m)).reshape(-1)
        if not self.received_finite(grad):
            return False
        at = 0
        for p in self.params:
            n = p.numel()
            p.grad = grad[at:at + n].view_as(p).to(p.dtype).clone()
            at += n
        self.compress_s += time.perf_counter() - t0
        return True

    def extra_state(self):
        return {"residuals": self.ef.state_dict(), "micro": self.micro}

    def load_extra_state(self, sd):
        self.ef.load_state_dict(sd["residuals"])
        self.micro = sd["micro"]

    def report(self):
        steps = max(self.steps_done, 1)
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / steps,
                "compressor": self.q.name, "error_feedback": self.options.error_feedback}

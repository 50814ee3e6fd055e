"""Quantized gradients with error feedback, into the run's optimizer:

    g  <- mean of `accum` micro-batch gradients
    g  <- compressed mean of every rank's g       two stages, error feedback at each (below)
    θ  <- opt(θ; g)                               replicated optimizer, like DDP

The compressed mean is 1-bit Adam's two-stage all-reduce (engines/compressed.py's CompressedAllReduce):
each rank quantizes its W shards (adding its residual), an all_to_all hands shard r to rank r,
which sums it in fp32 and quantizes it again (adding its own residual), and an all_gather
gives every rank the same mean. Q is int8 / int4 with a per-block absmax scale or 1-bit sign
with a per-block scale (lowcomm.compress). Bytes per step: 2(W-1)/W · (P·bits/8 + 4·P/block),
P padded to W whole blocks; the ring shape of DDP's all-reduce.

At 1 bit this feeds sign-compressed gradients to the optimizer, and with Adam that corrupts
its second moment: 1-bit Adam (strategy onebit_adam) freezes it after an exact warm-up and
compresses the momentum instead. `--bits 1` once meant 1-bit Adam, and with
--freeze-variance-after -1 (the default) or N > 0 it still does (`resolve` hands the run to
onebit_adam, with a note); `--freeze-variance-after 0` sends 1-bit gradients.

Under --elastic (contract/elastic.py) θ and the optimizer state are replicated (every rank steps
on the same mean) and the two error-feedback residuals are each rank's own: a joiner starts them
at zero, as DeepSpeed's 1-bit Adam resets the compression errors whenever it loads a checkpoint
(they are distinct on every GPU, and resetting them was verified not to hurt convergence).
Commit point: every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

from ..engines.compressed import compressed_allreduce, payload_bytes
from ..compress import quantizer_for_bits
from ..errors import UsageError
from ..contract.base import Strategy
from .onebit_adam import OneBitAdamOptions
from ..engines.costs import CompressedAllReduce
from ..contract.plan import PlannedOp
from ..contract.replica import splitting_inside
from ..contract.options import option
from ..contract.parts import LOCAL, Part
from .registry import register


@dataclass
class QuantizedOptions(OneBitAdamOptions):
    """The block size and error feedback of the compressed all-reduce, and `freeze_variance_after`
    only as part of the older spelling of onebit_adam (see `Quantized.resolve`)."""
    bits: int = option(8, "bits per gradient value on the wire: 8, 4 (int, absmax per block) or 1 (sign); "
                          "--bits 1 with --freeze-variance-after -1 or N > 0 runs onebit_adam", choices=(8, 4, 1))

    def check(self):
        if self.bits != 1 and self.freeze_variance_after > 0:
            raise UsageError(f"--freeze-variance-after {self.freeze_variance_after} freezes Adam's variance, which "
                             f"is 1-bit Adam (--strategy onebit_adam); quantized at --bits {self.bits} compresses "
                             "gradients into the run's optimizer: leave --freeze-variance-after at -1 or 0")

    def runs_onebit_adam(self) -> bool:
        return self.bits == 1 and self.freeze_variance_after != 0


@register("quantized")
class Quantized(Strategy):
    Options = QuantizedOptions
    # across replica groups: each position's blocks (engines/compressed.py's SplitByPosition); fsdp: its shards' blocks
    inside_replica = ("ddp", "fsdp")
    owns_tensors = False
    cost = CompressedAllReduce  # after the step; across replica groups each position's piece

    @classmethod
    def resolve(cls, options: QuantizedOptions):
        """The strategy a run of these options is (registry.resolve): onebit_adam for the older
        spelling `--bits 1` with -1 or N > 0 steps of warm-up, with the same numbers as before."""
        if not options.runs_onebit_adam():
            return cls.name, options, None
        kept = OneBitAdamOptions(**{f.name: getattr(options, f.name) for f in fields(OneBitAdamOptions)})
        return "onebit_adam", kept.validate("onebit_adam"), (
            "quantized --bits 1 runs 1-bit Adam (strategy onebit_adam: exact warm-up, then Adam's variance frozen "
            "and its momentum sent at 1 bit); --freeze-variance-after 0 sends 1-bit gradients instead")

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        if self.options.runs_onebit_adam():  # the Python API, where no config resolved the name
            raise UsageError("quantized with bits=1 and freeze_variance_after -1 or > 0 is 1-bit Adam: "
                             "use strategy 'onebit_adam' (freeze_variance_after=0 sends 1-bit gradients)")
        self.optimizer = make_optimizer(self.params)
        self.allreduce = compressed_allreduce(comm, splitting_inside(self), self.params, self.options.bits,
                                              self.options.block_size, self.options.error_feedback)

    @classmethod
    def comm_plan(cls, layout, world, options):
        total = payload_bytes(layout.numel, world, options.bits, options.block_size)
        name = quantizer_for_bits(options.bits, options.block_size).name
        return [PlannedOp("all_to_all", total, what=f"{name} gradient shards (worker -> owner)"),
                PlannedOp("all_gather", total, what=f"{name} summed shards (owner -> all)")]

    def use_comm(self, comm):
        self.comm = self.allreduce.comm = comm

    def update(self, ctx):
        self.reduce_inside()  # fsdp inside: the replica's mean gradient of this rank's shards
        mean = self.allreduce.mean(ctx, self.allreduce.flat([p.grad for p in self.params]))
        if mean is not None:
            t0 = time.perf_counter()
            for p, g in zip(self.params, self.allreduce.views(mean)):
                p.grad = g.to(p.dtype).clone()
            self.allreduce.compress_s += time.perf_counter() - t0
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_parts(self):
        """θ, the optimizer (replicated), the error feedback (this rank's own; a joiner's is zero)."""
        return {**super().state_parts(), "residuals": Part(self.allreduce.state_dict, self.allreduce.load_state_dict, LOCAL)}

    def report(self):
        return self.allreduce.report(self.steps_done)

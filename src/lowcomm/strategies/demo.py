"""DeMo: decoupled momentum (Peng, Quesnelle, Kingma, arXiv 2411.19870), as the authors'
standalone optimizer does it, with every byte through Comm.

Per parameter tensor, after `accum` micro-batches (g = their mean gradient):
    θ  <- θ · (1 - lr·wd)                          decoupled weight decay
    δ  <- β·δ + lr·g                               local momentum, never all-reduced
    (i, v) <- top-k per chunk of DCT(δ)            chunk length per dim = largest divisor <= target
    δ  <- δ - IDCT(i, v)                           remove what is sent
    all_gather (i, v) of every worker              one buffer for all tensors
    Q  <- IDCT(at each index, the mean of the values of the workers that sent it)
    θ  <- θ - lr·sign(Q)
lr and wd are the run's optimizer settings (read from make_optimizer's param_groups,
the schedule applied every step). Bytes per step: (W-1) · Σ_tensors blocks·k·(index + value
bytes); faithful default int64 indices and fp32 values (12 bytes per coefficient).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..compress import DCTTopK
from ..errors import UsageError
from ._gpt_shapes import gpt_shapes
from .base import Strategy
from .options import Options, option
from .plan import PlannedOp
from .registry import register


@dataclass
class DeMoOptions(Options):
    beta: float = option(0.999, "DeMo momentum decay β (0 <= β < 1)", flag="--demo-beta", min=0.0)
    chunk: int = option(64, "DCT chunk length per dimension (largest divisor not above it)",
                        flag="--demo-chunk", min=1)
    topk: int = option(32, "coefficients kept per chunk", flag="--demo-topk", min=1)
    values: str = option("fp32", "how kept coefficients are sent: fp32, bf16 or sign (1 bit + a scale per chunk)",
                         flag="--demo-values", choices=("fp32", "bf16", "sign"))
    compact_index: bool = option(False, "send indices in the smallest type addressing a chunk instead of int64",
                                 flag="--demo-compact-index")

    def check(self):
        if self.beta >= 1.0:
            raise UsageError(f"--demo-beta (demo.beta) must be below 1, got {self.beta}")


def _encoders(shapes, options, device=None) -> list[DCTTopK]:
    return [DCTTopK(s, options.chunk, options.topk, options.values, options.compact_index, device=device)
            for s in shapes]


@register("demo")
class DeMo(Strategy):
    Options = DeMoOptions

    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, options=None):
        super().__init__(model, comm, make_optimizer, accum, schedule, options)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.start_from_rank0(p.data for p in self.params)
        # The run's AdamW is built only to read lr / weight decay (and carry the schedule);
        # it never steps and holds no state.
        self.settings = make_optimizer(self.params)
        self.weight_decay = float(self.settings.param_groups[0].get("weight_decay", 0.0))
        self.encoders = _encoders([tuple(p.shape) for p in self.params], self.options,
                                  device=self.params[0].device)
        self.deltas = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.sizes = [e.nbytes() for e in self.encoders]
        self.micro = 0
        self.compress_s = 0.0
        self._watch_forward()

    @classmethod
    def comm_plan(cls, num_params, world, options, shapes=None):
        """One all_gather per step of every tensor's (indices, values). Depends on the
        parameter shapes: pass `shapes`, else lowcomm's GPT with this count is assumed."""
        shapes = shapes if shapes is not None else gpt_shapes(num_params)
        per_worker = sum(e.nbytes() for e in _encoders(shapes, options))
        return [PlannedOp("all_gather", world * per_worker, what="DCT top-k (index, value) of every tensor")]

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return 12 * num_params  # θ, ∇θ and the momentum δ (fp32); no AdamW state

    def optimizers(self):
        return [self.settings]

    def optimizer_state_bytes(self):
        return sum(d.numel() * d.element_size() for d in self.deltas)

    def begin_step(self):
        self.lr = self.lr_for_step(self.settings, self.steps_done)
        self._tally.lr = self.lr
        self.micro = 0

    def after_backward(self):
        self.micro += 1
        if self.micro < self.accum:
            return False
        self._step()
        for p in self.params:
            p.grad = None
        return True

    @torch.no_grad()
    def _step(self):
        """δ's new value is staged and θ changes only after the gather: a step that a non-finite
        gradient on any rank makes every rank's decoded Q non-finite is skipped without a trace."""
        lr, beta, wd = self.lr, self.options.beta, self.weight_decay
        t0 = time.perf_counter()
        sent, staged = [], []
        self.poison_nonfinite(*(p.grad for p in self.params if p.grad is not None))
        for p, delta, enc in zip(self.params, self.deltas, self.encoders):
            new = delta.mul(beta)
            if p.grad is not None:
                new.add_(p.grad, alpha=lr)
            idx, val = enc.compress(new)
            new.sub_(enc.decompress([idx], [val]))
            staged.append(new)
            sent += [idx.reshape(-1).view(torch.uint8), val.reshape(-1).view(torch.uint8)]
        mine = torch.cat(sent)
        gathered = torch.empty(self.comm.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_gather(gathered, mine)

        t0 = time.perf_counter()
        rows = gathered.view(self.comm.world, -1)
        at, qs = 0, []
        for enc, (idx0, val0) in zip(self.encoders, self._templates()):
            ni, nv = idx0.numel() * idx0.element_size(), val0.numel() * val0.element_size()
            idxs = [rows[w, at:at + ni].clone().view(idx0.dtype) for w in range(self.comm.world)]
            vals = [rows[w, at + ni:at + ni + nv].clone().view(val0.dtype) for w in range(self.comm.world)]
            at += ni + nv
            qs.append(enc.decompress(idxs, vals))
        if self.received_finite(*qs):
            for p, delta, new, q in zip(self.params, self.deltas, staged, qs):
                if wd != 0.0:
                    p.mul_(1.0 - lr * wd)
                p.add_(q.sign().to(p.dtype), alpha=-lr)
                delta.copy_(new)
        self.compress_s += time.perf_counter() - t0

    def _templates(self):
        """Per tensor, empty (index, value) tensors of the sent dtypes and sizes."""
        if not hasattr(self, "_tmpl"):
            self._tmpl = []
            for enc in self.encoders:
                idx = torch.zeros(enc.blocks, enc.k, dtype=torch.int64)
                val = torch.zeros(enc.blocks, enc.k)
                i, v = enc.pack(idx, val)
                self._tmpl.append((torch.empty(i.numel(), dtype=i.dtype), torch.empty(v.numel(), dtype=v.dtype)))
        return self._tmpl

    def extra_state(self):
        return {"deltas": [d.clone() for d in self.deltas], "micro": self.micro}

    def load_extra_state(self, sd):
        for d, saved in zip(self.deltas, sd["deltas"], strict=True):
            d.copy_(saved)
        self.micro = sd["micro"]

    def report(self):
        steps = max(self.steps_done, 1)
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / steps,
                "sent_bytes_per_worker_per_step": sum(self.sizes)}

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

What is kept where: δ̂ = DCT(δ), not δ. The chunked DCT is orthonormal and linear, so
δ̂ <- β·δ̂ + lr·DCT(g), top-k of δ̂, and "δ̂ at the sent indices minus the values sent" are
the authors' steps up to float rounding, with two transforms per step (DCT(g), IDCT(Q))
instead of three: removing what was sent needs no inverse DCT. Parameters whose blocks
have the same dims and width (a GPT's repeated layer shapes) are stacked into one group
(_Group), transformed and top-k'd together; δ̂ is one (blocks, block) tensor per group
(`_stacks`), and `self.deltas` holds each parameter's rows of it (views, in DCTTopK's
coefficient layout): that is what the checkpoint's "dct_momenta" saves and loads, bit-exact.
`momentum()` decodes δ. The wire stays per tensor, in parameter order, and Q is decoded
per tensor (DCTTopK.decompress, which keeps a zero scratch per tensor between steps).
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from ..compress import DCTTopK
from ..errors import UsageError
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


def _as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Received bytes (rows: workers) as `dtype`: a view where offset and row length
    allow, else a copy."""
    try:
        return buf.view(dtype)
    except RuntimeError:
        return buf.contiguous().view(dtype)


def _encoders(shapes, options, device=None) -> list[DCTTopK]:
    return [DCTTopK(s, options.chunk, options.topk, options.values, options.compact_index, device=device)
            for s in shapes]


class _Group:
    """Parameters whose blocks have the same dims and whose rows are equally long (1-D: the
    same chunk), transformed and top-k'd as one stack of rows: a GPT's many equal layer
    shapes then cost one matmul / topk / scatter each, not one per tensor. Member m's blocks
    are rows [r0, r1) of the stack's (blocks, block) coefficients, in the member's own order."""

    def __init__(self, members, encoders, options, device):
        self.members = members
        first = encoders[members[0]]
        self.one_d = len(first.dims) == 1
        self.widths = [math.prod(encoders[m].shape) if self.one_d else encoders[m].shape[0] for m in members]
        shape = (sum(self.widths),) if self.one_d else (sum(self.widths), math.prod(first.shape[1:]))
        self.enc = DCTTopK(shape, options.chunk, options.topk, options.values, options.compact_index,
                           device=device, dims=first.dims)
        ends = list(itertools.accumulate(encoders[m].blocks for m in members))
        self.rows = list(zip([0] + ends[:-1], ends))

    def stack(self, tensors):
        """The members' tensors (None: zeros) as the fp32 stack the encoder transforms; None if all are."""
        if all(t is None for t in tensors):
            return None
        tail, device = (() if self.one_d else self.enc.shape[1:]), self.enc.mats[0].device
        return torch.cat([torch.zeros(n, *tail, device=device) if t is None else t.reshape(n, *tail).float()
                          for t, n in zip(tensors, self.widths)])


def _groups(encoders, options, device) -> list[_Group]:
    by_key = {}
    for i, e in enumerate(encoders):
        key = e.dims if len(e.dims) == 1 else (e.dims, math.prod(e.shape[1:]))
        by_key.setdefault(key, []).append(i)
    return [_Group(members, encoders, options, device) for members in by_key.values()]


@register("demo")
class DeMo(Strategy):
    Options = DeMoOptions

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        # The run's AdamW is built only to read lr / weight decay (and carry the schedule);
        # it never steps and holds no state.
        self.settings = make_optimizer(self.params)
        self.weight_decay = float(self.settings.param_groups[0].get("weight_decay", 0.0))
        self.encoders = _encoders([tuple(p.shape) for p in self.params], self.options,
                                  device=self.params[0].device)
        # δ̂ = DCT(δ), kept per group (see the docstring); self.deltas: each parameter's rows
        self.groups = _groups(self.encoders, self.options, self.params[0].device)
        self._stacks = [torch.zeros(g.enc.blocks, g.enc.block, device=self.params[0].device) for g in self.groups]
        self._split_deltas()
        self.sizes = [e.nbytes() for e in self.encoders]
        self.compress_s = 0.0

    @classmethod
    def comm_plan(cls, layout, world, options):
        """One all_gather per step of every tensor's (indices, values): depends on each shape."""
        per_worker = sum(e.nbytes() for e in _encoders(layout.shapes, options))
        return [PlannedOp("all_gather", world * per_worker, what="DCT top-k (index, value) of every tensor")]

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        return 12 * num_params  # θ, ∇θ and the momentum δ (fp32); no AdamW state

    def optimizers(self):
        return [self.settings]

    def optimizer_state_bytes(self):
        return sum(d.numel() * d.element_size() for d in self.deltas)

    def begin_step(self, ctx):
        self.lr = ctx.lr = self.set_lr(ctx.step)

    def update(self, ctx):
        self._step(ctx)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _step(self, ctx):
        """δ̂'s new value is staged and θ changes only after the gather: a step that a non-finite
        gradient on any rank makes every rank's decoded Q non-finite is skipped without a trace."""
        lr, beta, wd = self.lr, self.options.beta, self.weight_decay
        t0 = time.perf_counter()
        grads = [group.stack([self.params[m].grad for m in group.members]) for group in self.groups]
        ctx.poison_nonfinite(*(g for g in grads if g is not None))  # what is sent, not p.grad
        packed, staged = [None] * len(self.params), []
        for group, delta, g in zip(self.groups, self._stacks, grads):
            new = delta.mul(beta)
            if g is not None:
                new.add_(group.enc.encode(g), alpha=lr)
            top, val = group.enc.topk(new)
            # Remove what was sent as the receivers decode it: exactly zero for fp32 values,
            # the rounding / sign error stays for bf16 / sign. No inverse DCT needed here.
            new.scatter_(-1, top, val - group.enc.unpack(*group.enc.pack(top, val))[1])
            staged.append(new)
            for m, (r0, r1) in zip(group.members, group.rows):  # the wire stays per tensor
                packed[m] = self.encoders[m].pack(top[r0:r1], val[r0:r1])
        mine = torch.cat([t.reshape(-1).view(torch.uint8) for pair in packed for t in pair])
        gathered = torch.empty(self.comm.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_gather(gathered, mine)

        t0 = time.perf_counter()
        rows = gathered.view(self.comm.world, -1)
        at, qs = 0, []
        for enc, (idx0, val0) in zip(self.encoders, self._templates()):
            ni, nv = idx0.numel() * idx0.element_size(), val0.numel() * val0.element_size()
            # every worker's (index, value) of this tensor, as (world, n) views of the buffer
            idxs, vals = _as(rows[:, at:at + ni], idx0.dtype), _as(rows[:, at + ni:at + ni + nv], val0.dtype)
            at += ni + nv
            qs.append(enc.decompress(idxs, vals))
        if ctx.received_finite(*qs):
            if wd != 0.0:
                torch._foreach_mul_(self.params, 1.0 - lr * wd)
            torch._foreach_add_(self.params, [q.sign().to(p.dtype) for p, q in zip(self.params, qs)], alpha=-lr)
            self._stacks[:] = staged
            self._split_deltas()
        self.compress_s += time.perf_counter() - t0

    def _split_deltas(self):
        """self.deltas: per parameter, a view of its rows of its group's δ̂ (blocks, block)."""
        self.deltas = [None] * len(self.params)
        for group, stack in zip(self.groups, self._stacks):
            for m, (r0, r1) in zip(group.members, group.rows):
                self.deltas[m] = stack[r0:r1]

    def momentum(self) -> list[torch.Tensor]:
        """δ in the parameters' domain (the inverse DCT of the δ̂ kept), one per parameter."""
        return [enc.decode(d) for enc, d in zip(self.encoders, self.deltas)]

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
        return {"dct_momenta": [d.clone() for d in self.deltas]}

    def load_extra_state(self, sd):
        if "dct_momenta" not in sd:  # lowcomm before δ̂ saved δ under "deltas"
            raise UsageError("demo: this checkpoint holds DeMo's momentum in the parameters' domain, "
                             "from an older lowcomm; it cannot be resumed by this version")
        for d, saved in zip(self.deltas, sd["dct_momenta"], strict=True):
            d.copy_(saved)

    def report(self):
        steps = max(self.steps_done, 1)
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / steps,
                "sent_bytes_per_worker_per_step": sum(self.sizes)}

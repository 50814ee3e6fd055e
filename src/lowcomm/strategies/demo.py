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
lr and wd are the tensor's param group's, as torch's optimizers read them: make_optimizer
builds the run's optimizer only to hold them, the schedule scales each group every step,
and a parameter in no group never moves. Bytes per step: (W-1) · Σ_tensors blocks·k·(index
+ value bytes); faithful default int64 indices and fp32 values (12 bytes per coefficient).

What is kept where: δ̂ = DCT(δ), not δ. The chunked DCT is orthonormal and linear, so
δ̂ <- β·δ̂ + lr·DCT(g), top-k of δ̂, and "δ̂ at the sent indices minus the values sent" are
the authors' steps up to float rounding, with two transforms per step (DCT(g), IDCT(Q))
instead of three: removing what was sent needs no inverse DCT. Tensors of equal block
shapes in the same param group (one lr) are transformed as one stack
(compress.dct_stacks.DCTStacks); δ̂ is one (blocks, block) tensor per stack (`_stacks`), and
`self.deltas` holds each parameter's rows of it (views, in DCTTopK's coefficient layout):
that is what the checkpoint's "dct_momenta" saves and loads, bit-exact. `momentum()`
decodes δ. The wire stays per tensor, in parameter order.

Under --elastic (contract/elastic.py) θ is replicated (every worker applies the same sign(Q)) and
δ̂ is each worker's own: never communicated in the algorithm, it is what this worker has not yet
sent. A joiner starts it at zero, as every worker did at step 0 (and as the authors' optimizer
creates it, zeros at its first step); survivors keep theirs. Commit point: every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..compress.dct_stacks import DCTStacks, encoders
from ..errors import UsageError
from ..contract.base import Strategy
from ..contract.options import Options, option
from ..contract.parts import LOCAL, Part, optimizer_part
from ..contract.plan import PlannedOp
from ..contract.replica import part_is_engines
from ..engines.costs import DeMoCost
from ..engines.step_scoring import StepScoring
from ..robust import GatheredUpdate, GatheredRobustOptions
from .registry import register


@dataclass
class DeMoOptions(GatheredRobustOptions, Options):  # --attack, --aggregate, --score (robust/gathered.py)
    beta: float = option(0.999, "DeMo momentum decay β (0 <= β < 1)", flag="--demo-beta", min=0.0)
    chunk: int = option(64, "DCT chunk length per dimension (largest divisor not above it)",
                        flag="--demo-chunk", min=1)
    topk: int = option(32, "coefficients kept per chunk", flag="--demo-topk", min=1)
    values: str = option("fp32", "how kept coefficients are sent: fp32, bf16 or sign (1 bit + a scale per chunk)",
                         flag="--demo-values", choices=("fp32", "bf16", "sign"))
    compact_index: bool = option(False, "send indices in the smallest type addressing a chunk instead of int64",
                                 flag="--demo-compact-index")

    def check(self):
        super().check()
        if self.beta >= 1.0:
            raise UsageError(f"--demo-beta (demo.beta) must be below 1, got {self.beta}")

    def check_model(self, layout):
        largest = max(e.block for e in encoders(layout.shapes, self.chunk, self.topk))
        if self.topk >= largest:  # (a smaller tensor's chunk keeps all of its coefficients: it is sent whole)
            raise UsageError(f"--demo-topk {self.topk} keeps every coefficient of every chunk of this model "
                             f"(the largest chunk holds {largest}): nothing is compressed; use fewer")


def check_rows_per_shard(params, K: int) -> None:
    """With fsdp inside every rank of a replica of K must hold a row of every tensor: torch.chunk
    gives a tensor of d rows ceil(d/K) a rank, so the last ranks hold none where d is small, and
    DeMo's DCT of an empty shard has no chunk. Refused alike on every rank (from whole shapes)."""
    for p in params:
        rows = p.shape[0]
        if -(-rows // K) * (K - 1) >= rows:
            raise UsageError(f"demo with --inside fsdp: a tensor of shape {tuple(p.shape)} has too few rows for a "
                             f"replica of {K} ranks (one would hold none, and DeMo's DCT needs a chunk); "
                             f"use fewer ranks per replica or --inside ddp")


@register("demo")
class DeMo(GatheredUpdate, Strategy):
    Options = DeMoOptions
    inside_replica = ("ddp", "fsdp")  # across replica groups: on the tensors each position owns (fsdp: its shards)
    cost = DeMoCost  # one all-gather after the step; no AdamW state

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        if part_is_engines(self):
            check_rows_per_shard(self.replica_params, self.inside.comm.world)
        # The run's optimizer, built only to hold each param group's lr and weight decay (and
        # carry the schedule): it never steps and holds no state.
        self.settings = make_optimizer(self.params)
        member = {id(p): g for g, group in enumerate(self.settings.param_groups) for p in group["params"]}
        self.param_group = [member.get(id(p)) for p in self.params]  # indices: a load replaces the dicts
        o, device = self.options, self.params[0].device
        self.dct = DCTStacks([tuple(p.shape) for p in self.params], o.chunk, o.topk, o.values, o.compact_index,
                             device=device, keys=self.param_group)
        self.encoders = self.dct.encoders
        self._stacks = self.dct.zeros(device)  # δ̂, per stack (see the docstring)
        self.deltas = self.dct.split(self._stacks)
        self.compress_s = 0.0
        self.scoring = StepScoring(self, lambda: [self._hyper(i)[0] for i in range(len(self.params))]) \
            if o.score else None  # --score (robust/gathered.py): probed at each tensor's lr of the step

    @classmethod
    def comm_plan(cls, layout, world, options):
        """One all_gather per step of every tensor's (indices, values): depends on each shape."""
        o = options
        per_worker = sum(e.nbytes() for e in encoders(layout.shapes, o.chunk, o.topk, o.values, o.compact_index))
        return [PlannedOp("all_gather", world * per_worker, what="DCT top-k (index, value) of every tensor")]

    def optimizers(self):
        return [self.settings]

    def optimizer_state_bytes(self):
        return sum(d.numel() * d.element_size() for d in self.deltas)

    def update(self, ctx):
        self.reduce_inside()  # across replica groups: the replica's mean gradient of the owned tensors
        self._step(ctx)
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _step(self, ctx):
        """δ̂'s new value is staged and θ changes only after the gather: a step that a non-finite
        gradient on any rank makes every rank's decoded Q non-finite is skipped without a trace."""
        t0 = time.perf_counter()
        grads = [s.stack([self.params[m].grad for m in s.members]) for s in self.dct.stacks]
        ctx.poison_nonfinite(*(g for g in grads if g is not None))  # what is sent, not p.grad
        staged, sent = [], []
        for j, (s, delta, g) in enumerate(zip(self.dct.stacks, self._stacks, grads)):
            new = delta.mul(self.options.beta)
            if g is not None:
                new.add_(s.enc.encode(g), alpha=self._hyper(s.members[0])[0])
            top, val = s.enc.topk(new)
            # Remove what was sent as the receivers decode it: exactly zero for fp32 values,
            # the rounding / sign error stays for bf16 / sign. No inverse DCT needed here.
            new.scatter_(-1, top, val - s.enc.unpack(*s.enc.pack(top, val))[1])
            staged.append(new)
            sent.append((top, self.attacked_values(f"stack{j}", val)))  # --attack: on the values it sends
        mine = self.attacked_payload(self.dct.pack(sent))
        gathered = torch.empty(self.comm.world * mine.numel(), dtype=torch.uint8, device=mine.device)
        self.compress_s += time.perf_counter() - t0
        self.comm.all_gather(gathered, mine)

        t0 = time.perf_counter()
        qs = self.combined(self.dct.decode, gathered.view(self.comm.world, -1), ctx.step)  # --aggregate, --score
        if ctx.received_finite(*qs):
            self._apply_signs(qs)
            self._stacks[:] = staged
            self.deltas = self.dct.split(self._stacks)
        self.compress_s += time.perf_counter() - t0

    def _apply_signs(self, qs) -> None:
        """θ <- θ·(1 - lr·wd) - lr·sign(Q), each param group at its own lr and weight decay."""
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(self.param_group):
            if g is not None:
                by_group.setdefault(g, []).append(i)
        for members in by_group.values():
            lr, wd = self._hyper(members[0])
            params = [self.params[i] for i in members]
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, [qs[i].sign().to(self.params[i].dtype) for i in members], alpha=-lr)

    def _hyper(self, i: int) -> tuple[float, float]:
        """(lr, weight decay) of parameter i's param group, as the schedule set them for this
        step; (0, 0) for a parameter in no group."""
        g = self.param_group[i]
        if g is None:
            return 0.0, 0.0
        group = self.settings.param_groups[g]
        return float(group["lr"]), float(group.get("weight_decay", 0.0))

    def momentum(self) -> list[torch.Tensor]:
        """δ in the parameters' domain (the inverse DCT of the δ̂ kept), one per parameter."""
        return [enc.decode(d) for enc, d in zip(self.encoders, self.deltas)]

    def state_parts(self):
        """θ and the settings (replicated); δ̂, this worker's own (a joiner's is zero: the docstring)."""
        return {**super().state_parts(), "settings": optimizer_part(self.settings),
                "dct_momenta": Part(lambda: [d.clone() for d in self.deltas], self._load_momenta, LOCAL)}

    def _load_momenta(self, saved: list) -> None:
        for d, value in zip(self.deltas, saved, strict=True):
            d.copy_(value)

    def report(self):
        return {"compress_s": self.compress_s, "compress_s_per_step": self.compress_s / max(self.steps_done, 1),
                "sent_bytes_per_worker_per_step": self.dct.nbytes(), **self.untrusted_report()}

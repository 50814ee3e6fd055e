"""Aggregators of an outer step: every worker's contribution, gathered as rows of X [W, n],
-> the one vector the outer optimizer takes as its gradient [n].

    mean              (1/W) Σ_r x_r                                 (what an all-reduce computes)
    median            per coordinate, the middle value; an even count averages the two middle
                      ones (numpy's rule), so it is the mean at W = 2
    trimmed:β         per coordinate, drop the b = ⌊β·W⌋ largest and the b smallest, average the rest
    centered-clip:τ   Karimireddy, He, Jaggi (ICML 2021), centered clipping: from v_0 (the
                      coordinate-wise median, so the rule keeps no state between rounds)
                          v ← v + (1/W) Σ_r (x_r − v)·min(1, τ/‖x_r − v‖)
                      CENTERED_CLIP_ITERS times; a fixed point has Σ_r clip_τ(x_r − v) = 0
    median-norm-clip  Covenant's validator (one-covenant/templar): per tensor, each worker's
                      values scaled by min(1, m/(‖x_r‖ + 1e-8)), m the median of the workers'
                      norms of that tensor (torch.median: the lower middle of an even count),
                      then the mean

Across replica groups (--replicas) each rank holds only part of every row: the coordinate-wise
rules run on that part as they would on the whole (per coordinate), and a norm needs the whole:
`Spread` sums the rank's partial squares over its replica (one small all-reduce: W values for
centered clipping's row norms, W per tensor for median-norm-clip where tensors are sharded, none
where each rank holds whole tensors).

A compressed wire (top-k) gathers payloads a worker sent only some values of: `support`
[W, n] (1 where worker r sent coordinate j) makes every mean above the mean over the
workers that sent the coordinate (SparseLoCo's and DeMo's decode), and the coordinate-wise
rules look only at the senders (a coordinate nobody sent stays 0). Every rank holds the same
X and computes the same aggregate bit for bit: nothing here depends on the rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import UsageError

CENTERED_CLIP_ITERS = 5
NORM_EPS = 1e-8  # Covenant's: a zero contribution is not divided by zero
NAMES = ("mean", "median", "trimmed:β", "centered-clip:τ", "median-norm-clip")


def mean(x: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of the rows (of the rows that sent each coordinate, given `support`)."""
    if support is None:
        return x.mean(dim=0)
    senders = support.sum(dim=0)
    return torch.where(senders > 0, (x * support).sum(dim=0) / senders.clamp(min=1), torch.zeros_like(x[0]))


def median(x: torch.Tensor, support: torch.Tensor | None = None) -> torch.Tensor:
    """The coordinate-wise median (an even count: the mean of the two middle values)."""
    return _sorted_mean(x, support, lambda count: ((count - 1) // 2, count // 2 + 1))


def trimmed(x: torch.Tensor, beta: float, support: torch.Tensor | None = None) -> torch.Tensor:
    """The coordinate-wise β-trimmed mean: ⌊β·count⌋ dropped on each side."""
    return _sorted_mean(x, support, lambda count: ((count * beta).floor(), count - (count * beta).floor()))


def _sorted_mean(x, support, keep) -> torch.Tensor:
    """Per coordinate, the mean of the sorted values at ranks [lo, hi) (`keep(count)` -> lo, hi),
    count the coordinate's senders (all W without `support`; those not sent sort last)."""
    W = x.shape[0]
    if support is None:
        count = torch.full_like(x[0], float(W))
        values = x.sort(dim=0).values
    else:
        count = support.sum(dim=0)
        values = torch.where(support > 0, x, torch.full_like(x, float("inf"))).sort(dim=0).values
    lo, hi = keep(count)
    lo, hi = torch.as_tensor(lo, dtype=x.dtype, device=x.device), torch.as_tensor(hi, dtype=x.dtype, device=x.device)
    ranks = torch.arange(W, dtype=x.dtype, device=x.device).unsqueeze(1)
    kept = (ranks >= lo) & (ranks < hi)
    total = torch.where(kept, values, torch.zeros_like(values)).sum(dim=0)
    return torch.where(count > 0, total / (hi - lo).clamp(min=1), torch.zeros_like(total))


@dataclass(frozen=True)
class Spread:
    """How the rows are spread over a replica's ranks (None where a rank holds them whole):
    `total(partial)` sums each rank's partial sums of squares (collective: every rank of the
    replica calls it alike); `whole_tensors`: each rank holds whole tensors (ddp inside), so a
    tensor's norm is its own."""
    total: Callable[[torch.Tensor], torch.Tensor]
    whole_tensors: bool


def spread_over(inside) -> Spread:
    """How this rank's part of each row lies in its replica (`inside`: engines/inside.py's engine
    inside it): with ddp inside a position owns whole tensors, with fsdp a shard of each; a norm
    sums the positions' partial squares in one bookkeeping all-reduce inside the replica (W or
    W x tensors values a sync: Comm.meta, as --score's table)."""
    return Spread(lambda partial: inside.comm.meta_all_reduce(partial, op="sum"), whole_tensors=inside.name == "ddp")


def norms(x: torch.Tensor, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Each row's norm [W]: of the row here, or (`total`) of the whole row spread over a replica."""
    if total is None:
        return x.norm(dim=1)
    return total(x.double().pow(2).sum(dim=1)).sqrt().to(x.dtype)


def centered_clip(x: torch.Tensor, tau: float, iters: int = CENTERED_CLIP_ITERS,
                  start: torch.Tensor | None = None, total=None) -> torch.Tensor:
    """Centered clipping from `start` (default: the coordinate-wise median), `iters` iterations
    (`total`: the rows spread over a replica, Spread.total)."""
    v = median(x) if start is None else start.clone()
    for _ in range(iters):
        diff = x - v
        scale = (tau / norms(diff, total).clamp(min=NORM_EPS)).clamp(max=1.0)
        v = v + (diff * scale.unsqueeze(1)).mean(dim=0)
    return v


def median_norm_clip(x: torch.Tensor, sizes: list[int] | None = None,
                     support: torch.Tensor | None = None, total=None) -> torch.Tensor:
    """Covenant's merge: per tensor (`sizes`, else the whole row), each row clipped to the median
    of the rows' norms, then the mean (over the senders, given `support`). `total`: each tensor
    sharded over a replica (Spread.total), its norms summed there in one all-reduce [W, tensors]."""
    return mean(clipped_to_median_norm(x, sizes, total), support)


def clipped_to_median_norm(x: torch.Tensor, sizes: list[int] | None = None, total=None) -> torch.Tensor:
    """Every row as Covenant's merge takes it: per tensor, scaled to at most the median norm."""
    parts = x.split(sizes or [x.shape[1]], dim=1)
    if total is None:
        each = torch.stack([part.norm(dim=1) for part in parts], dim=1)
    else:
        each = total(torch.stack([part.double().pow(2).sum(dim=1) for part in parts], dim=1)).sqrt().to(x.dtype)
    factor = (each.median(dim=0).values / (each + NORM_EPS)).clamp(max=1.0)  # [W, tensors]
    return torch.cat([part * factor[:, t:t + 1] for t, part in enumerate(parts)], dim=1)


@dataclass(frozen=True)
class Aggregator:
    """A parsed --aggregate: its rule and parameter (β or τ)."""
    rule: str
    param: float = 0.0

    @property
    def spec(self) -> str:
        return f"{self.rule}:{self.param:g}" if self.rule in ("trimmed", "centered-clip") else self.rule

    @property
    def robust(self) -> bool:
        """Does it need every worker's contribution (an all-gather), not only their sum?"""
        return self.rule != "mean"

    def __call__(self, x: torch.Tensor, sizes: list[int] | None = None,
                 support: torch.Tensor | None = None, spread: Spread | None = None) -> torch.Tensor:
        """X [W, n] (rows in rank order) -> the aggregate [n]; `spread`: each row spread over a
        replica's ranks, this rank holding its part (the norm-based rules sum their squares there)."""
        if self.rule == "median":
            return median(x, support)
        if self.rule == "trimmed":
            return trimmed(x, self.param, support)
        if self.rule == "centered-clip":
            return centered_clip(x if support is None else x * support, self.param,
                                 total=spread.total if spread else None)
        if self.rule == "median-norm-clip":
            sharded = spread is not None and not spread.whole_tensors
            return median_norm_clip(x, sizes, support, total=spread.total if sharded else None)
        return mean(x, support)

    def check_world(self, world: int, name: str = "--aggregate") -> None:
        """Refuse what `world` workers make pointless: a trimmed mean that trims none."""
        if self.rule == "trimmed" and int(self.param * world) < 1:
            fix = f"give β of at least {1 / world:g}" if world > 2 else "a trimmed mean needs 3 workers or more"
            raise UsageError(f"{name} {self.spec} trims ⌊{self.param:g}·{world}⌋ = 0 of {world} workers on each "
                             f"side (the mean): {fix}")


def decoded_senders(decode, rows: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every sender's bytes (rows [W, b]) decoded alone -> (their tensors flat, one row each, fp32
    [W, n]; one sender's tensors, to shape an aggregate of the rows back like them)."""
    per = [decode(rows[r:r + 1]) for r in range(rows.shape[0])]
    return torch.stack([torch.cat([q.reshape(-1).float() for q in qs]) for qs in per]), per[0]


def aggregated(aggregator: Aggregator, flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The aggregate of decoded rows (decoded_senders), tensor by tensor, shaped and typed `like`."""
    sizes = [q.numel() for q in like]
    agg = aggregator(flat, sizes)
    return [a.view(q.shape).to(q.dtype) for a, q in zip(agg.split(sizes), like)]


def parse_aggregator(spec: str, name: str = "--aggregate") -> Aggregator:
    """'mean', 'median', 'trimmed:0.25', 'centered-clip:1.0', 'median-norm-clip' -> an Aggregator."""
    rule, _, raw = str(spec).strip().partition(":")
    if rule in ("mean", "median", "median-norm-clip") and not raw:
        return Aggregator(rule)
    if rule in ("trimmed", "centered-clip") and raw:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if rule == "trimmed" and not 0 < value < 0.5:
            raise UsageError(f"{name} '{spec}': β must be a number above 0 and below 0.5 (the share trimmed "
                             f"on each side), got '{raw}'")
        if rule == "centered-clip" and not 0 < value < float("inf"):
            raise UsageError(f"{name} '{spec}': τ must be a positive number (the clipping radius), got '{raw}'")
        return Aggregator(rule, value)
    raise UsageError(f"{name} '{spec}' is not one of: {', '.join(NAMES)}")

"""What runs inside a replica group (--inside), below the strategy that runs across replicas.

With --replicas R of --workers W, each replica's K = W/R processes act as one worker of the
strategy: `ddp` averages their gradients every step, so every rank of a replica holds the
same parameters (comm/groups.py forms the groups). A strategy either syncs everything across
replicas after `reduce` (diloco: what R single workers would send, in each of the K groups)
or splits it by position with `scatter` / `gather` (ddp, as HSDP: each cross group all-reduces
its position's 1/K, so the K groups together send what R single workers would).
A strategy declares what it runs under (Strategy.inside_replica); the rest are refused at
start-up in one line. `fsdp` (parameters sharded inside a replica) is named but not built yet.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from ..errors import UsageError
from ..models.layout import ModelLayout
from .context import flat_of, write_flat
from .plan import PlannedOp

INSIDE = ("ddp", "fsdp")   # what --inside may name
BUILT = ("ddp",)           # what runs today


class InsideDDP:
    """Gradients averaged over the replica's ranks (fp32, one all-reduce per step)."""

    name = "ddp"

    def __init__(self, comm: Comm):
        self.comm = comm

    def reduce(self, tensor: torch.Tensor) -> None:
        """In place: the mean of `tensor` over the replica's ranks."""
        self.comm.all_reduce(tensor, op="avg")

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece (its position's 1/K, `flat` zero-padded to a multiple of K) of
        the mean of `flat` over the replica's ranks (one reduce-scatter)."""
        K, n = self.comm.world, flat.numel()
        padded = flat if n % K == 0 else torch.cat([flat, flat.new_zeros(K - n % K)])
        piece = flat.new_empty(padded.numel() // K)
        self.comm.reduce_scatter(piece, padded, op="avg")
        return piece

    def gather(self, piece: torch.Tensor, numel: int) -> torch.Tensor:
        """Every rank's `piece` of the replica put together (one all-gather), padding cut off."""
        out = piece.new_empty(piece.numel() * self.comm.world)
        self.comm.all_gather(out, piece)
        return out[:numel]

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Every parameter's gradient averaged over the replica (one flat all-reduce)."""
        grads = [p.grad for p in params if p.grad is not None]
        flat = flat_of(grads)
        self.reduce(flat)
        write_flat(flat, grads)

    @staticmethod
    def plan(layout: ModelLayout) -> list[PlannedOp]:
        """What one rank sends inside its replica per trainer step."""
        return [PlannedOp("all_reduce", 4 * layout.numel, what="gradients inside the replica (fp32)")]


def make_inside(kind: str, comm: Comm | None) -> InsideDDP | None:
    """The engine inside this rank's replica (None: a flat run, no replica group)."""
    if comm is None:
        return None
    if kind not in BUILT:
        raise UsageError(f"--inside {kind} is not supported yet (choose from: {', '.join(BUILT)})")
    return InsideDDP(comm)


def check_replicas(cfg, supported: list[str]) -> None:
    """UsageError (one line) unless --replicas, --inside, --intra-link and the strategy of `cfg`
    (config.RunConfig) fit together (`supported`: the strategies that run under its --inside)."""
    workers, replicas, inside, strategy = cfg.workers, cfg.replicas, cfg.inside, cfg.strategy
    if replicas < 0:
        raise UsageError(f"replicas must be at least 1 (0: one per worker), got {replicas}")
    R = replicas or workers
    if workers % R:
        raise UsageError(f"--replicas {R} does not divide --workers {workers} (each replica holds "
                         f"workers/replicas processes)")
    if inside not in INSIDE:
        raise UsageError(f"unknown --inside '{inside}' (choose from: {', '.join(INSIDE)})")
    if inside not in BUILT:
        raise UsageError(f"--inside {inside} is not supported yet (strategy '{strategy}'; "
                         f"choose from: {', '.join(BUILT)})")
    if R < workers and strategy not in supported:
        raise UsageError(f"strategy '{strategy}' does not run across replica groups yet (--replicas {R} of "
                         f"--workers {workers}; with --inside {inside}: {', '.join(supported)})")
    if cfg.intra_link.bandwidth is not None and R == workers:
        raise UsageError(f"--intra-link needs replica groups: --replicas fewer than --workers ({workers})")

"""A strategy across replica groups (base.py's docstring says how), and every rank's start from
rank 0's values."""
from __future__ import annotations

import torch


def start_from_rank0(s) -> None:
    """Every rank of strategy `s` starts from rank 0's values (a bookkeeping broadcast, as DDP does at
    construction), so a Python-API user who forgot to seed identically still trains one model."""
    # Across replicas from replica 0, then inside each replica from its first rank.
    comms = [c for c in (s.comm, getattr(s.inside, "comm", None)) if c is not None and c.world > 1]
    if not comms:
        return
    # Tensor by tensor: a flat copy of the whole model would be a start-up memory peak.
    with torch.no_grad():
        for p in s.replica_params:
            buffer = p.data if p.data.is_contiguous() else p.data.contiguous()
            for comm in comms:
                comm.meta_broadcast(buffer, src=0)
            if buffer is not p.data:
                p.data.copy_(buffer)


def splitting_inside(s):
    """The engine inside the replica of strategy `s` where it splits the replica's work itself
    (owns_tensors False, ddp inside); None in a flat run or on a part (fsdp's shards)."""
    return None if s.owns_part else s.inside


def part_is_engines(s) -> bool:
    """Whether the part strategy `s` runs on is storage the engine inside owns (fsdp's shards, which
    FSDP all-gathers from): it may write into it, not re-point it."""
    return s.owns_part and s.inside.reshapes_model


def model_reusable(s) -> bool:
    """Whether a run on another group (a new elastic membership) can be built on the model of
    strategy `s`: not once the engine inside reshaped it for this group (fsdp's fully_shard)."""
    return s.inside is None or not s.inside.reshapes_model


class ReplicaPart:
    """The replica side of Strategy (base.py): which part of the model this rank runs the
    strategy on, and the reductions inside its replica. Reads the Strategy's comm, inside,
    owns_tensors, inside_replica and replica_params (the functions above, too)."""

    @property
    def owns_part(self) -> bool:
        """Whether this rank runs the strategy on the part of the model the engine inside gives it:
        with ddp inside, the tensors its position owns (a strategy that splits the replica's work
        itself declares owns_tensors False); with fsdp inside always, FSDP's shards of every tensor."""
        return self.inside is not None and (self.owns_tensors or self.inside.reshapes_model)

    def reduce_inside(self, op: str = "avg") -> None:
        """Across replica groups: each owned gradient <- its mean ("avg") or sum over the
        replica, the rest dropped; a flat run: nothing."""
        if self.owns_part:
            self.inside.reduce_to_owners(self.replica_params, op)

    def share_inside(self, counted: bool = True) -> None:
        """Across replica groups: every tensor <- its owner's value (the driver's, after each
        step; `counted=False`: bookkeeping, e.g. around an evaluation); a flat run: nothing."""
        if self.owns_part:
            self.inside.share(self.replica_params, counted)

    @classmethod
    def runs_inside(cls, inside: str) -> bool:
        """Whether this strategy runs across replica groups with engine `inside` inside each."""
        return inside in vars(cls).get("inside_replica", ())

"""Replica groups: the one place a run's two levels of process groups are formed.

W processes as R replicas of K = W/R ranks each (HSDP's layout):

    replica r holds the ranks r·K .. r·K + K−1          (the intra-replica group, fast links)
    position p of every replica: the ranks p, p+K, ..   (the cross-replica group, R ranks)

so a rank is in one intra group (its replica's K ranks) and one cross group (the R ranks at
its position), and the K cross groups run side by side. R = W (K = 1) is the flat run: no
group is formed and the strategy runs on the world, as it always did.

Every rank must create every group in the same order (torch's new_group is collective over
the world), so `form` creates all of them, and the control group the run driver agrees on
beside each cross group (comm/control.py), on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch.distributed as dist

from .comm import Comm, CommStats
from .control import register_control


@dataclass(frozen=True)
class ReplicaLayout:
    """Which replica and position each of `world` ranks holds, with `replicas` replicas."""
    world: int
    replicas: int

    @property
    def size(self) -> int:
        """K: ranks per replica."""
        return self.world // self.replicas

    @property
    def flat(self) -> bool:
        return self.size == 1

    def replica(self, rank: int) -> int:
        return rank // self.size

    def position(self, rank: int) -> int:
        return rank % self.size

    def intra_ranks(self) -> list[list[int]]:
        """Each replica's ranks, replica by replica."""
        return [list(range(r * self.size, (r + 1) * self.size)) for r in range(self.replicas)]

    def cross_ranks(self) -> list[list[int]]:
        """Each position's ranks across the replicas, position by position."""
        return [list(range(p, self.world, self.size)) for p in range(self.size)]


@dataclass
class ReplicaGroups:
    """This rank's two levels: `intra` inside its replica, `cross` across the replicas."""
    layout: ReplicaLayout
    intra: Comm
    cross: Comm


def form(layout: ReplicaLayout, intra_link=None, cross_link=None) -> ReplicaGroups:
    """Create every replica's and every position's group (collective over the world, the
    same order on every rank) and this rank's Comm on each: `cross_link` shapes the
    cross-replica level, `intra_link` the level inside a replica (None: unshaped)."""
    intra, _ = dist.new_subgroups_by_enumeration(layout.intra_ranks())
    cross, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks())
    control, _ = dist.new_subgroups_by_enumeration(layout.cross_ranks(), backend="gloo")
    register_control(cross, control)
    return ReplicaGroups(layout, Comm(intra, link=intra_link, level="intra"),
                         Comm(cross, link=cross_link, level="cross"))


def combined(comms: list[Comm]) -> CommStats:
    """The counters of several levels added up (the driver's per-step totals); one level's as they are."""
    return total(by_level(comms).values())


def by_level(comms: list[Comm]) -> dict[str, CommStats]:
    """Each level's counters, by Comm.level, read once (so that they and their total agree)."""
    return {comm.level: comm.snapshot() for comm in comms}


def total(stats) -> CommStats:
    """Several levels' counters added up; one level's as they are."""
    stats = list(stats)
    if len(stats) == 1:
        return stats[0]
    return CommStats(*(sum(getattr(s, f.name) for s in stats) for f in fields(CommStats)))

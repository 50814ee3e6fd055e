"""The wiring every run shares, written once: each rank's emulated links (one seed per rank and
per level), its Comm on the whole group, the replica groups (comm/groups.py) and the strategy on
the right level of them (driver.make_run). The CLI's runs, plain and elastic (train/assemble.py,
for every membership), and wrap() call these; each keeps its own order around them (a torchrun
worker checks node numbering before the groups form, an elastic member shortens their timeouts
before the strategy's first collective).

A link is given as a function of its seed (None: unshaped), so that the CLI's config and wrap()'s
"BW,LAT[,JIT]" strings make theirs the same way.
"""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist
import torch.nn as nn

from ..comm import Comm
from ..comm.groups import ReplicaGroups, ReplicaLayout, form
from ..comm.link import LinkModel
from ..contract.base import MakeOptimizer
from ..engines.optim import covering
from ..comm.pacer import Pacer
from .driver import RunDriver, make_run

LinkOf = Callable[[int], "LinkModel | None"]  # a link from its seed


def link_seed(seed: int, rank: int, intra: bool = False) -> int:
    """The seed of rank `rank`'s emulated link: each NIC jitters on its own, and the link inside
    its replica (`intra`) apart from the one across replicas."""
    return (seed + intra) * 7919 + rank


def make_pacer(rank: int, world: int, slowdown: float = 1.0, stragglers: tuple[float, float] | None = None,
               seed: int = 0) -> Pacer | None:
    """The emulated device of this rank (its slowdown factor, and P,F stragglers), or None."""
    prob, factor = stragglers or (0.0, 1.0)
    if slowdown == 1.0 and prob <= 0:
        return None
    return Pacer(rank, world, slowdown, prob, factor, seed)


def world_comm(layout: ReplicaLayout, rank: int, seed: int, link: LinkOf,
               group: dist.ProcessGroup | None = None) -> Comm:
    """This rank's Comm on the whole group: the level the strategy runs on in a flat run
    ("cross"), bookkeeping beside replica groups ("world")."""
    return Comm(group, link=link(link_seed(seed, rank)), level="cross" if layout.flat else "world")


def replica_groups(layout: ReplicaLayout, rank: int, seed: int, link: LinkOf,
                   intra_link: LinkOf) -> ReplicaGroups | None:
    """The replica groups of this rank (collective over the world), each level's link seeded
    apart; None in a flat run."""
    if layout.flat:
        return None
    return form(layout, intra_link(link_seed(seed, rank, intra=True)), link(link_seed(seed, rank)))


def build(strategy: str, model: nn.Module, make_optimizer: MakeOptimizer, comm: Comm | None,
          groups: ReplicaGroups | None, **run) -> RunDriver:
    """The strategy across replicas with `run["inside"]` inside each (groups), or on `comm` (flat);
    an optimizer that would leave a trainable tensor out is refused (engines/optim.covering)."""
    return make_run(strategy, model, groups.cross if groups else comm, covering(make_optimizer, model),
                    replica=groups.intra if groups else None, **run)

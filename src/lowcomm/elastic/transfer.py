"""The live state from a peer to the members that are behind (a joiner, a survivor that rolled
back further than another), over the quorum's own group.

Every member of a quorum reports its committed step; the members behind the newest take the
state of the lowest rank that has it. The state travels pickled with its tensors
(broadcast_object_list), so it arrives bit for bit; every member takes part, since it is one
collective.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import torch
import torch.distributed as dist

from .membership import View


def heal(view: View, state: Callable[[], dict], load: Callable[[dict], None], group=None) -> list[int]:
    """Bring every member to the newest committed state; returns the ranks that received it.
    In replicas of K processes (replicas.py) each holds 1/K of the state, so position p of a
    replica behind takes position p's state from the first replica at the newest step, over
    `group`: the ranks at this rank's position (None: the world, K = 1)."""
    newest, K = max(view.steps), view.size()
    behind = [r for r, s in enumerate(view.steps) if s < newest]
    if not behind:
        return []
    donor = view.steps.index(newest) + view.rank % K  # the donor replica's first rank, plus this position
    box = [state() if view.rank == donor else None]
    dist.broadcast_object_list(box, src=donor, group=group)
    if view.rank in behind:
        load(box[0])
    return behind


def state_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors' bytes (the parts every member must hold alike)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

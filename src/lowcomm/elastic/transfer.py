"""The live state from a peer to the members that are behind (a joiner, a survivor that rolled
back further than another), over the quorum's own group.

Every member of a quorum reports its committed step; the members behind the newest take the
state of the lowest rank that has it. The state travels pickled with its tensors through the
run's Comm (comm/objects.py's broadcast_object, book "heal"), so it arrives bit for bit and, like
every other byte of the run, is counted (comm.books["heal"]), recorded in the flight ring ("heal")
and paced by an emulated --link (one latency + S / bandwidth, S the pickled state's bytes); every
member takes part, since it is one collective. What it cost is the heal's record (Healed.record),
which membership.jsonl keeps for the quorum, and `heal_totals` sums a run's for summary.json.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from ..comm import Comm
from ..comm.objects import broadcast_object
from .membership import View

BOOK = "heal"  # the Comm's counters and flight-ring name of a heal's bytes


class Healed(list):
    """The ranks that received the state (a list, as heal always returned), with `record`: what
    the heal moved and cost on this rank, {"from": the donor's slot, "bytes": the pickled state's
    size, "seconds": this rank's time in the transfer, "link_s": what the emulated link prices it
    at (0 without one)}; None when no member was behind."""
    record: dict | None = None


def heal(view: View, state: Callable[[], dict], load: Callable[[dict], None], group=None) -> Healed:
    """Bring every member to the newest committed state; returns the ranks that received it.
    In replicas of K processes (replicas.py) each holds 1/K of the state, so position p of a
    replica behind takes position p's state from the first replica at the newest step, over
    `group`: the Comm of the ranks at this rank's position (the run's levels[0]: counted, recorded
    and paced there), or a process group (None: the world, K = 1; counted in a Comm of its own)."""
    newest, K = max(view.steps), view.size()
    behind = [r for r, s in enumerate(view.steps) if s < newest]
    if not behind:
        return Healed()
    comm = group if isinstance(group, Comm) else Comm(group)
    donor = view.steps.index(newest) + view.rank % K  # the donor replica's first rank, plus this position
    # ranks at one position, replica by replica: the donor's rank in that group is its replica's index
    sent = broadcast_object(comm, state() if view.rank == donor else None, src=donor // K, book=BOOK)
    if view.rank in behind:
        load(sent.value)
    healed = Healed(behind)
    healed.record = {"from": view.slots[donor], "bytes": sent.nbytes, "seconds": round(sent.seconds, 6),
                     "link_s": round(comm.link.duration("broadcast", sent.nbytes, comm.world), 6) if comm.link else 0.0}
    return healed


def heal_totals(membership_jsonl: Path | str) -> dict:
    """The heals of a run's membership.jsonl added up, for summary.json: how many, their bytes
    and their seconds (each the lead's, as recorded), and what the emulated link priced them at."""
    heals = [q["heal"] for q in _records(Path(membership_jsonl)) if q.get("heal")]
    return {"heals": len(heals), "bytes": sum(h["bytes"] for h in heals),
            "seconds": round(sum(h["seconds"] for h in heals), 6),
            "link_s": round(sum(h.get("link_s", 0.0) for h in heals), 6)}


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def state_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of named tensors' bytes (the parts every member must hold alike)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

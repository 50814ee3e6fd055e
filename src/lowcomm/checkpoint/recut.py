"""A checkpoint of another number of workers, re-cut for this run's: one code for a plain
`--resume` (state.load) and an elastic run's first quorum (elastic/checkpoints.py).

Each rank takes the state of its own rank in the checkpoint. A rank the checkpoint has not (more
workers than wrote it) takes rank 0's at its replica position as a joiner takes a peer's: its
local parts fresh, then what follows from the peer's state (contract/parts.py's as_joiner and
after_join). A sharded state (a strategy with SHARDED parts: zero1, acco, dpu) is first put
together from the shards of every rank at this position (whole_from_shards) and cut anew for this
membership (member_state), as an elastic run's commit state is. A replicated state (ddp) is read
from the checkpoint's shared part.

Ranks are numbered replica by replica, K processes a replica (K = 1 in a flat run): a process's
state is its position's in its replica (its tensors, its FSDP shard), so the checkpoint's ranks at
this position are position, position + K, ...; a checkpoint of replicas of another K cannot be
re-cut (`refusal`) unless its state is replicated.
"""
from __future__ import annotations

from ..contract.parts import after_join, as_joiner, laid_out, member_state, whole_from_shards
from .choose import Found
from .state import read_state


def refusal(found: Found, strategy: str, world: int, per_replica: int) -> str | None:
    """Why checkpoint `found` cannot be re-cut for `world` workers in replicas of `per_replica`
    processes, in one line; None when it can."""
    if found.world == world or found.replicated or found.per_replica == per_replica:
        return None
    was, replicas = found.per_replica, world // per_replica  # --replicas stays (the config's hash holds it)
    return (f"checkpoint {found.path} was written by replicas of {was} process(es) and strategy '{strategy}' keeps "
            f"each process's state by its position in its replica (its tensors, its shard), which cannot be re-cut "
            f"for replicas of {per_replica}; resume with --workers {was * replicas}")


def load_recut(run, found: Found, rank: int, per_replica: int) -> dict:
    """Load into `run` (a RunDriver of a membership where this process is `rank`) its state re-cut
    from checkpoint `found` of another number of workers (module docstring). Returns what was read
    for this rank: its own namespace ("step", "loader", "rng", "run" and "strategy"), or only
    "strategy" where the state is replicated."""
    parts = run.strategy.state_parts()
    at_position = range(rank % per_replica, found.world, per_replica)
    own = rank if rank < found.world else at_position[0]
    state = read_state(found, None if found.replicated else own)
    whole = state["strategy"]
    if laid_out(parts):  # sharded across the ranks at this position
        whole = whole_from_shards(parts, [whole if r == own else read_state(found, r)["strategy"] for r in at_position])
    load_member(run, whole, joining=rank >= found.world)
    return state


def load_member(run, whole: dict, joining: bool) -> None:
    """Load into `run` this member's cut (member_state) of a commit's whole state: its own, or, as
    a joiner, a peer's with its local parts fresh, then what follows from the peer's state (an
    elastic run's heal and rollback load their snapshots so too)."""
    parts = run.strategy.state_parts()
    run.load_state_dict(member_state(parts, as_joiner(parts, whole) if joining else whole))
    if joining:
        after_join(parts)

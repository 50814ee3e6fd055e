"""Checkpoints of an elastic run, and `--resume` of one with the workers it is started with.

Written at commit points (where every member holds the same state) by the members of the
quorum then, with the checkpoint package's own writer (DCP, every member its file, rank 0 the
manifest, renamed into place when complete: atomic as a plain run's), at every multiple of
--checkpoint-every and at --stop-at. A run stopped at --stop-at ends without summary.json, as a
plain run does, and `lowcomm train --resume RUNDIR` continues it.

A resumed run loads the checkpoint at its first quorum. Each member takes the state of its own
rank in it: with as many workers as wrote it, its data position and RNG too, so the run goes on
as if it had never stopped (bit for bit, a test checks it). With another number of workers it
continues with the membership it finds: a member whose rank the checkpoint does not have takes
rank 0's (as a joiner takes a peer's state; zero1's sharded optimizer state is first put together
from every rank's shard and cut anew, reshard.from_shards), and the data position follows from the
step and the new membership (loop.loader_for), as after any change of membership.
"""
from __future__ import annotations

from pathlib import Path

from ..checkpoint import read, read_state, save
from ..errors import UsageError
from . import reshard


def end_step(cfg) -> int:
    """The step this part of the run ends at: --stop-at, else --steps."""
    return min(cfg.stop_at, cfg.steps) if cfg.stop_at else cfg.steps


def due(cfg, step: int) -> bool:
    every = cfg.checkpoint_every
    return bool(every and step % every == 0) or (step == end_step(cfg) and bool(every or cfg.stop_at))


def check(cfg, commit_every: int) -> None:
    """Checkpoints and stops fall on commit points: diloco's outer syncs."""
    for flag, value in (("--checkpoint-every", cfg.checkpoint_every), ("--stop-at", cfg.stop_at)):
        if value and value % commit_every and value != cfg.steps:
            raise UsageError(f"{flag} {value} with --elastic must be a multiple of --sync-every {commit_every} "
                             f"(an elastic diloco run's state agrees across workers only at its outer syncs)")


def write(worker, wall_s: float) -> None:
    """Collective over the current members: the checkpoint of this commit point."""
    save(worker.t, worker.out_dir, worker.cfg.keep, wall_s=wall_s)


def load(worker, view) -> float:
    """The first quorum of a resumed run: this member's state from the checkpoint (see above).
    Returns the wall seconds of the run's earlier parts."""
    t, found = worker.t, read(Path(worker.cfg.resume_from))
    same = found.world == view.world
    rank = view.rank if view.rank < found.world else 0
    state = read_state(found, None if found.replicated and not same else rank)
    if same:  # step, strategy, data position and RNG: as if never stopped
        t.load_state_dict(state)
    elif worker.cfg.strategy in reshard.GATHERED:  # each rank's shard: the whole state, cut for this membership
        shards = [state["strategy"] if r == rank else read_state(found, r)["strategy"] for r in range(found.world)]
        reshard.load(worker.cfg.strategy, t.run, reshard.from_shards(shards, t.run.strategy.flat.numel))
        t.step = found.step
    else:
        t.run.load_state_dict(state["strategy"])
        t.step = found.step
    worker.step = t.step
    if not same:
        worker.restart_data()
    return float(state.get("run", {}).get("wall_s", 0.0))

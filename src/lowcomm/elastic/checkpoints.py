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
rank 0's as a joiner takes a peer's (its local state fresh; a sharded optimizer state is first
put together from every rank's shard and cut anew: the strategy's whole_from_shards and
member_state), and the data position follows from the step and the new membership
(train/elastic.py's loader_for), as after any change of membership.
"""
from __future__ import annotations

from itertools import islice
from pathlib import Path

from ..checkpoint import read, read_state, save
from ..errors import UsageError


# Checkpoint steps checked against the commit points: the strategies' commit points repeat with
# their sync period, so a bad --checkpoint-every shows within its first few multiples.
CHECKED = 10_000


def end_step(cfg) -> int:
    """The step this part of the run ends at: --stop-at, else --steps."""
    return min(cfg.stop_at, cfg.steps) if cfg.stop_at else cfg.steps


def due(cfg, step: int) -> bool:
    every = cfg.checkpoint_every
    return bool(every and step % every == 0) or (step == end_step(cfg) and bool(every or cfg.stop_at))


def check(cfg, is_commit) -> None:
    """Checkpoints and stops fall on commit points (`is_commit(step)`: the strategy's)."""
    for flag, value in (("--checkpoint-every", cfg.checkpoint_every), ("--stop-at", cfg.stop_at)):
        every = range(value, cfg.steps, value) if flag == "--checkpoint-every" and value else [value] if value else []
        bad = next((step for step in islice(every, CHECKED) if not is_commit(step)), None)
        if bad is not None:
            first = [step for step in range(1, min(cfg.steps, 10_000)) if is_commit(step)][:4]
            raise UsageError(f"{flag} {value} with --elastic puts a checkpoint at step {bad}, which is not a commit "
                             f"point of strategy '{cfg.strategy}' (where its workers' state agrees: steps "
                             f"{', '.join(map(str, first))}, ...)")


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
    s = t.run.strategy
    if same:  # step, strategy, data position and RNG: as if never stopped
        t.load_state_dict(state)
    else:  # this rank's state (rank 0's for a rank it has not: as a joiner's); sharded: put together
        whole = state["strategy"]
        if s.sharded_state:
            whole = s.whole_from_shards([whole if r == rank else read_state(found, r)["strategy"]
                                         for r in range(found.world)])
        joiner = view.rank >= found.world
        t.run.load_state_dict(s.member_state(s.as_joiner(whole) if joiner else whole))
        if joiner:
            s.join_from_peer()
        t.step = found.step
    worker.step = t.step
    if not same:
        worker.restart_data()
    return float(state.get("run", {}).get("wall_s", 0.0))

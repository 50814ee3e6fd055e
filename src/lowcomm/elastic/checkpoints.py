"""Checkpoints of an elastic run, and `--resume` of one with the workers it is started with.

Written at commit points (where every member holds the same state) by the members of the
quorum then, with the checkpoint package's own writer (DCP, every member its file, rank 0 the
manifest, renamed into place when complete: atomic as a plain run's), at the first commit
point at or after each multiple of --checkpoint-every, and at --stop-at (itself a commit
point). A run stopped at --stop-at ends without summary.json, as a plain run does, and
`lowcomm train --resume RUNDIR` continues it.

A resumed run loads the checkpoint at its first quorum. Each member takes the state of its own
rank in it: with as many workers as wrote it, its data position and RNG too, so the run goes on
as if it had never stopped (bit for bit, a test checks it). With another number of workers it
continues with the membership it finds: a member whose rank the checkpoint does not have takes
rank 0's as a joiner takes a peer's (its local state fresh; a sharded optimizer state is first
put together from every rank's shard and cut anew: the strategy's whole_from_shards and
member_state), and the data goes on from the stream's committed position with the new
membership (train/member_data.py's loader_for), as after any change of membership. A run of
replicas of K processes resumes on the replicas it finds, of K processes each (checkpoint/resume.py refuses
another K): what is said above of ranks holds position by position -- a process takes the
state of its position in its own replica, or in replica 0 for a replica the checkpoint has not,
a sharded state put together from the shards of its position's ranks across the replicas.
"""
from __future__ import annotations

import socket
from pathlib import Path

from ..checkpoint import read, read_state, save
from ..comm.objects import all_gather_object
from ..checkpoint.recut import load_recut
from ..data.loader import stream_position
from ..errors import RunError, UsageError


CHECKED = 10_000  # the steps searched for the first commit points a refusal names


def check(cfg, is_commit) -> None:
    """--stop-at falls on a commit point (`is_commit(step)`: the strategy's). (A checkpoint of
    --checkpoint-every N is written at the first commit point at or after each multiple of N.)"""
    if cfg.stop_at and not is_commit(cfg.stop_at):
        first = [step for step in range(1, min(cfg.steps, CHECKED)) if is_commit(step)][:4]
        raise UsageError(f"--stop-at {cfg.stop_at} with --elastic stops at a step that is not a commit point of "
                         f"strategy '{cfg.strategy}' (where its workers' state agrees: steps "
                         f"{', '.join(map(str, first))}, ...)")


def write(worker, wall_s: float) -> None:
    """Collective over the current members: the checkpoint of this commit point, beside the
    quorum's records."""
    save(worker.t, run_dir(worker), worker.cfg.keep, wall_s=wall_s)


def run_dir(worker) -> Path:
    """The directory of the quorum's records (worker.lead_log, 'HOST:PATH' of its steps.jsonl),
    where every member writes its part of a checkpoint: one directory, as a checkpoint is. It is
    the run's --out, but under torchrun each job has its own --out and this is the lead job's,
    which every member must reach at that path (one machine, or a filesystem every node sees);
    the members agree on that first, so that none waits in a write the others do not start."""
    host, _, steps = (worker.lead_log or "").partition(":")
    folder = Path(steps).parent
    reached = all_gather_object(worker.t.comm, bool(steps) and (host == socket.gethostname() or folder.is_dir()))
    if not all(reached):
        away = [worker.view.slots[r] for r, ok in enumerate(reached) if not ok]
        raise RunError(f"cannot write a checkpoint into {folder} on {host}, beside the run's records: process(es) "
                       f"{', '.join(map(str, away))} do not see it; every member's machine must see that directory at "
                       f"that path (a shared filesystem; under torchrun, for the --out of each job)")
    return folder


def load(worker, view) -> float:
    """The first quorum of a resumed run: this member's state from the checkpoint (see above).
    Returns the wall seconds of the run's earlier parts."""
    t, found = worker.t, read(Path(worker.cfg.resume_from))
    same = found.world == view.world
    if same:  # step, strategy, data position and RNG: as if never stopped
        state = read_state(found, view.rank)
        t.load_state_dict(state)
    else:  # re-cut as a plain --resume does (checkpoint/recut.py), with K a replica as when written
        state = load_recut(t.run, found, view.rank, view.size())
        t.step = found.step
    worker.step = t.step
    if not same:  # the stream's committed position, alike in every rank's loader state
        loader = state.get("loader") or read_state(found, 0).get("loader")
        worker.restart_data(stream_position(loader))
    return float(state.get("run", {}).get("wall_s", 0.0))

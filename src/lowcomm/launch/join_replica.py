"""`lowcomm join RUNDIR` into a run of replica groups (`lowcomm train --elastic --replicas R`):
one more replica, of the K = W/R processes a replica of the run has.

The joiner takes the next free slot from the run's store (the launcher's replicas are slots
0..R-1, joiners count on from R, as one-worker joiners count on from W), and starts its K
processes as the launcher starts a slot (train/replica_run.py's slot_entry, as a joiner): its
process 0 asks the lighthouse for a quorum, the members take it in at their next quorum request
(every ~2 s, at a commit point), and position p of the new replica receives position p's
state from a replica of the run. From there it is a replica like the others; when one of its
processes fails, the others are stopped and the joiner ends in one line (a launcher's slot would
be restarted; a joiner is not, as a one-worker joiner is not).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import RunError
from . import supervise
from .join import NEXT_SLOT, PUBLISHED


def join_replica(run: Path, cfg, where: dict, store, quiet: bool) -> int:
    """Train as one more replica of the run in `run` until the run ends (exit 0), or say why not."""
    from ..train.replica_run import slot_entry, slot_store
    K = cfg.workers // cfg.replicas
    slot = cfg.replicas + int(store.add(NEXT_SLOT, 1)) - 1
    if not quiet:
        print(f"lowcomm: joining the run in {run} as replica {slot} ({K} processes)", flush=True)
    host, port = where["store"]
    replica = Replica(run, slot_store(store, slot, 0))
    supervise.run_workers(slot_entry, (slot, cfg, port, where["lighthouse"], str(run), quiet, True, 0, host), K,
                          watch=lambda _: replica.until_joined())
    if not quiet:
        first, last = replica.trained(K)
        print(f"lowcomm: replica {slot} trained steps {first} to {last} of the run in {run}"
              f"{' (it has finished)' if last >= cfg.steps else ''}", flush=True)
    return 0


class Replica:
    """The joining replica as the run's records show it, by the id its process 0 puts in its job store."""

    def __init__(self, run: Path, job):
        self.run, self.job, self.id = run, job, ""

    def quorums(self) -> list[tuple[dict, int]]:
        """The quorums in the run's membership.jsonl that held this replica, with its index there."""
        if not self.id and self.job.check(["replica_id"]):
            self.id = self.job.get("replica_id").decode()
        try:
            lines = (self.run / "membership.jsonl").read_text().splitlines() if self.id else []
        except FileNotFoundError:
            return []
        quorums = [json.loads(line) for line in lines if self.id in line]
        return [(q, q["replicas"].index(self.id)) for q in quorums if self.id in q.get("replicas", ())]

    def until_joined(self) -> None:
        """Before a quorum holds the replica: the run ending first (its launcher removed
        elastic.json, or summary.json appeared) ends the joiner in one line, instead of its
        process 0 asking a lighthouse that is gone."""
        if self.quorums():
            return
        if (self.run / "summary.json").exists() or not (self.run / PUBLISHED).exists():
            raise RunError(f"the run in '{self.run}' ended before this replica could join it")

    def trained(self, K: int) -> tuple[int, int]:
        """The first and last step this replica trained, read from the run's records."""
        joined = self.quorums()
        if not joined:
            return 0, 0
        q, i = joined[0]
        mine = set(q["slots"][i * K:(i + 1) * K])  # its processes' slots in the quorum that took it in
        records = [json.loads(line) for line in (self.run / "steps.jsonl").read_text().splitlines()]
        trained = [r["step"] for r in records if r["step"] > q["step"] and mine & set(r.get("members", ()))]
        return q["step"] + 1, max(trained, default=q["step"])

"""An elastic member: form, heal, roll back, commit; what it keeps across memberships is
member_life.py's, and its steps are trained by the run's one loop (loop.py), to which the member
is the membership policy (start, gathers_at, before_step, committed, leaves).

A commit point is where every member holds the same replicated state, as the strategy declares
(contract/elastic.py). There the members gather the steps' records (the gather is the commit),
rank 0 writes them, and each member keeps a snapshot of its state (replicated and local parts, a
sharded state gathered whole). When a collective fails (a peer died), the member drops the run on
the broken group, goes back to its snapshot -- the steps since are discarded, never half-applied --
and asks the lighthouse for a quorum with its committed step. There the members behind the newest
(a joiner, a restarted worker) take its state from a peer (transfer.py), their local parts fresh,
and all train on from that step, reading the run's data stream from where the commit left it
(member_data.py). Checkpoints are written at commit points; a resumed run loads one at its first
quorum (elastic/checkpoints.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import config as C
from . import member_log
from ..comm.objects import all_gather_object
from ..diagnose.postmortem import lost_in
from ..errors import RunError, StateLost
from .faults import watched
from .loop import Progress, loop
from .member_data import commit_position
from .member_life import MemberLife
from ..checkpoint.recut import load_member
from ..elastic import checkpoints, support, transfer
from .rounds import snapshot_of
from ..elastic.membership import Membership, View, leave
from .replica_run import elastic_entry  # noqa: F401 (the launcher starts a worker there)

MAX_REFORMS_WITHOUT_PROGRESS = 20  # re-forming again and again without a commit: give up, one line
NO_STATE_WAIT_S = 1.0  # a quorum of fresh members only: ask again after this (times the tries, up to 5)


class NoStateHere(Exception):
    """The quorum's members are all fresh processes (restarted, or from `lowcomm join`): none holds
    the run's state. The members that do may still be on their way (the lighthouse formed a
    quorum before they asked): leave, and ask again."""


class ElasticWorker(MemberLife):
    """One member: what it keeps across memberships (member_life.py), how it forms, heals, rolls
    back and commits, and the membership policy of the training loop (loop.py) for each membership."""

    # -- membership ---------------------------------------------------------------------
    def form(self, joining: bool) -> View:
        """A quorum, its group, a run on it, and every member on the newest committed state."""
        committed = self.snapshot["step"] if self.snapshot is not None else (-1 if joining else 0)
        view = self.m.agree(committed, joining=joining)
        if max(view.steps) < 0:  # only fresh processes: starting over would overwrite the run's records
            raise NoStateHere(f"a quorum of {view.world} member(s) formed at the lighthouse, none of them "
                              f"holding the run's state")
        if view is self.view and self.t is not None:  # the same members on the same group (replicas.py)
            self.joins_seen = self._joins_answered()
            self._open_outputs()
            return view
        self._build(view)
        self.joins_seen = self._joins_answered()
        if self.snapshot is not None:
            self.load(self.snapshot)
        else:  # the run's start: every member takes its snapshot (collective when sharded)
            # The first quorum of a resumed run. A member that comes to a later one (a replica that
            # missed the first: under torchrun they start apart) is behind its peers: it heals.
            if self.cfg.resume_from and not joining and max(view.steps) <= 0:
                self.progress.t_start -= checkpoints.load(self, view)
            self.snapshot = self._take_snapshot()
        # counted, recorded and paced on the Comm of this rank's position across the replicas
        healed = transfer.heal(view, lambda: self.snapshot, self._resume, self.t.run.levels[0])
        resumed = self.hash_of(self.snapshot)  # the committed state this member resumed from
        self.snapshot = self._take_snapshot(self.snapshot["log"])
        in_round = self.round.rejoin(self) if self.round is not None else None
        self._record(view, healed, resumed, in_round)
        return view

    def _joins_answered(self) -> int:
        """The announcements this quorum answered (a later one is news), alike on every member:
        the most any member has seen, so that all of them see the same news at a commit point."""
        return max(all_gather_object(self.t.comm, self.m.joins()))

    def _take_snapshot(self, log: dict | None = None) -> dict:
        """The state at a commit point, with `log`: the steps.jsonl records that commit made and
        the file they are due in (the quorum lead's). They travel with the state (transfer.heal),
        so the lead of the next quorum writes any the lead of this one did not: a commit is not
        atomic. After the gather the members still (a sharded state) gather the snapshot, a
        collective; a member can finish it while the lead fails in it or dies, and the step
        the others committed would have no record."""
        return {"step": self.step, "strategy": snapshot_of(self.t.run), "log": log or {"file": None, "records": []},
                "draws": self.t.loader.committed}

    def load(self, snapshot: dict, joining: bool = False) -> None:
        """This member's state from a snapshot: its own, or (`joining`) a peer's, whose local
        parts it starts as a fresh worker would (contract/elastic.py)."""
        load_member(self.t.run, snapshot["strategy"], joining)
        self.step = self.t.step = snapshot["step"]
        self.restart_data(snapshot.get("draws", 0))

    def _resume(self, snapshot: dict) -> None:
        """Take a peer's newer committed state (transfer.heal), as a joiner."""
        self.snapshot = snapshot
        self.load(snapshot, joining=True)

    def _record(self, view: View, healed: list[int], resumed: str, in_round: int | None) -> None:
        """membership.jsonl (rank 0, member_log.py): each member's hash of the committed state all
        must hold alike, taken after it was loaded into this membership, with the hash of the state
        each resumed from, and after a fault what each survivor saw of it. A new lead continues
        steps.jsonl with the records its predecessor committed but did not write."""
        log_file = self._log_file()
        every = all_gather_object(self.t.comm, (self.hash_of(self.snapshot), resumed, log_file, self.fault))
        self.lead_log, self.fault = every[0][2], None  # where this quorum's records go
        self._open_outputs()
        if self.outputs.lead:
            member_log.write_quorum(self.out_dir, view, self.snapshot["step"], in_round, healed, every)
            log = self.outputs.log
            member_log.write_due(log, self.snapshot["log"], log_file)
            p = self.progress
            p.totals, p.loss, p.val_loss = self.outputs.kept_totals(self.cfg.workers)
            self.contributors = {r["step"]: r["outer"]["contributors"] for r in log.kept if "outer" in r}

    # -- the training loop's membership policy (loop.py) ---------------------------------
    def start(self, t) -> None:
        """Nothing to wait for: the quorum has just formed, its group's timeout is the member timeout."""

    def gathers_at(self, step: int, due: bool) -> bool:
        """Only at commit points: a gathered record is a committed step, written once."""
        return self.is_commit(step)

    def before_step(self, t, progress: Progress) -> None:
        self.step = t.step
        self.m.progress()
        if self.round is not None and self.is_commit(t.step + 1):
            self.round.keep(self)

    def joins(self) -> int:
        return self.m.joins()

    def committed(self, t, records: list[dict]) -> None:
        """The members finished these steps: the records say who they were (and who contributed
        to an outer merge), and each member keeps the state it goes back to if a peer is lost."""
        self.step = t.step
        now = time.time()  # when the step was committed (bench/chaos.py times recoveries by it)
        for r in records:
            r["members"], r["committed_at"] = list(self.view.slots), now
        outer = support.outer_record(t.run)
        if outer is not None:  # an outer sync: who contributed to it, and how much
            records[-1]["outer"] = outer
            self.contributors[self.step] = outer["contributors"]
        self.since = self.snapshot["step"]  # the last commit point before this one
        commit_position(t.loader, t.comm)  # the data stream's, recorded in the snapshot
        self.snapshot = self._take_snapshot({"file": self.lead_log, "records": records})
        if self.round is not None:
            self.round.forget()

    def save(self, t, wall_s: float) -> None:
        """The members of this quorum, at this commit point (checkpoints.py)."""
        checkpoints.write(self, wall_s)

    def leaves(self, step: int, joins: int) -> bool:
        """Re-form for a joiner that has announced itself. One waiting at the last commit point is
        not taken in: there is nothing left to train (it would finish the run as a member that
        trained nothing, counted in the summary)."""
        return joins > self.joins_seen and step < self.cfg.end_step

    # -- faults and the end ---------------------------------------------------------------
    def rollback(self) -> None:
        """A collective failed: forget the run on the broken group and the steps since the snapshot."""
        view = self.m.latest  # the quorum agreed on last: formed, or failing to form (a joiner lost in its transfer)
        if view is not None:  # the fault's record (membership.jsonl): who was there, and where it failed
            self.fault = {"members": list(view.slots), "in": lost_in(self.flight)}
        if self.t is not None:
            self.t.run.release()
            self.t = None  # DDP's reducer holds the group: let it go with the run
        # Destroy the broken group now, not after the next quorum: its sockets close, so a survivor
        # still blocked in the failed collective (waiting on this member, not on the dead one)
        # fails at once instead of after --timeout, and joins the quorum too.
        leave()
        self.step = self.snapshot["step"] if self.snapshot is not None else 0
        self.progress.pending = []  # a round state (rounds.py) may bring back those of the round


def run_elastic(cfg: C.RunConfig, slot: int, membership: Membership, out_dir: Path | None, quiet: bool,
                joining: bool) -> ElasticWorker:
    """One elastic worker's life, from its first quorum to the end of the run (the worker, ended)."""
    torch.set_num_threads(cfg.threads)
    w = ElasticWorker(cfg, slot, membership, out_dir, quiet)
    if not joining:
        membership.wait_for_first(cfg.workers)
    w.progress.t_start = time.perf_counter()
    reforms, why = 0, ""  # memberships in a row that committed no step, and why the last one ended
    while True:
        failed, committed = False, w.step
        try:
            w.form(joining)
            joining = False
            committed = w.step
            w.progress.forget_after(w.step)  # evaluated past the state this membership resumed from
            result = loop(w.t, w.outputs, watched(w), w.progress)  # watched: the test faults asked for
            if result is not None:
                break
            why = "a joiner came"
        except NoStateHere as e:  # every member is fresh: wait for one that holds the run's state
            why = str(e)
            w.rollback()
            time.sleep(min(reforms + 1, 5) * NO_STATE_WAIT_S)
            reforms += 1
            if reforms > MAX_REFORMS_WITHOUT_PROGRESS:
                raise StateLost(f"{e}: every worker that held the run's state is gone; go on from its last "
                                f"checkpoint with lowcomm train --resume {w.cfg.out or 'OUT'}") from None
            continue
        except RuntimeError as e:  # gloo: a peer closed the connection (died), or a collective timed out
            if not lost_peer(e):
                raise
            failed, why = True, " ".join(str(e).split())[:200]
        # A membership that committed a step ends the count: a long run meets many faults, each
        # after progress, and none of them is a reason to give up.
        reforms = 0 if w.snapshot is not None and w.snapshot["step"] > committed else reforms
        reforms += 1  # a re-form: for a joiner, or after a failure
        if failed:
            # Out of the except block: its traceback holds the broken group (DDP's reducer, c10d's
            # frames), and a group still held keeps its sockets open through destroy_process_group,
            # so a survivor blocked on this member waited --member-timeout instead of failing at once.
            w.rollback()
            # Announce ourselves as a joiner would: if we were the one cut off (frozen past
            # --member-timeout, then continued), the members went on without us and ask for a
            # quorum again only when told; if we are a survivor, the announcement is in the count
            # the new quorum agrees on (_joins_answered), so it costs nothing.
            joining = True
        if reforms > MAX_REFORMS_WITHOUT_PROGRESS:
            raise RunError(f"the group changed {reforms} times without committing a step (the last: {why}); "
                           f"giving up")
    if result.stopped:  # --stop-at, or a stop asked by a signal
        w.stop()
    else:
        w.finish(result)
    return w


def lost_peer(e: BaseException) -> bool:
    """Is this how gloo (or a timeout) reports a member that went away?"""
    text = str(e).lower()
    return isinstance(e, dist.DistBackendError) or any(m in text for m in (
        "connection closed by peer", "connection reset by peer", "timed out", "timeout", "broken pipe",
        "connection refused", "read error", "write error", "gloo"))

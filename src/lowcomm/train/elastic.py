"""An elastic worker: train between commit points; on a lost peer roll back and re-form.

A commit point is where every member holds the same replicated state, as the strategy declares
(contract/elastic.py): after every step, or after each outer sync of the local-SGD family. There
the members gather the steps' records (the gather is the commit: a member that got them knows
every member finished those steps), rank 0 writes them to steps.jsonl, and each member keeps a
copy of its state (the snapshot: replicated and local parts, a sharded state gathered whole).

When a collective fails (a peer died: gloo reports the closed connection at once), the member
drops the run built on the broken group, goes back to its snapshot -- the steps since are
discarded, never half-applied -- and asks the lighthouse for a quorum with its committed step.
In the new quorum the members behind the newest take its state from a peer (transfer.py), its
local parts started as a fresh worker's (zeros: a residual is never copied from a peer), so a
step that some member committed is kept and none is applied twice; the members then train on
from that step, each reading the run's data stream from where the commit left it (see `loader_for`).
The steps themselves are trained by the run's one loop (loop.py): the worker is its membership
policy (start, gathers_at, before_step, committed, leaves), so a plain run's bad-step guard,
dashboards, progress view, flight recorder, --trace, pace and stop on a signal are an elastic run's.
A joiner (a restarted worker, or one more from `lowcomm join`) asks for a quorum as soon as it
has built its model; the members notice its announcement at their next commit point and re-form
with it. Checkpoints are written at commit points, and a resumed run loads one at its first
quorum (checkpoints.py).
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import config as C
from . import run_end
from ..comm.flight import FlightRecorder
from ..comm.groups import ReplicaLayout
from ..data import load_tokens
from .member_data import commit_position, loader_for, val_for
from ..diagnose.postmortem import lost_in
from ..diagnose.trace import Tracer
from ..errors import RunError, StateLost
from ..metrics.summary import Totals
from .assemble import Seat, connect, strategy_run
from .faults import hold_for_joiner_if_asked, kill_if_asked, note_commit_if_asked
from .loop import LoopResult, Progress, loop
from .outputs import StepOutputs
from .worker import Trainer, ask_checkpoint_on_sigterm, build_model, pick_device
from ..elastic import checkpoints, support, transfer
from .rounds import RoundState, snapshot_of
from ..elastic.membership import Membership, View, leave

MAX_REFORMS_WITHOUT_PROGRESS = 20  # re-forming again and again without a commit: give up, one line
NO_STATE_WAIT_S = 1.0  # a quorum of fresh members only: ask again after this (times the tries, up to 5)


class NoStateHere(Exception):
    """The quorum's members are all fresh processes (restarted, or from `lowcomm join`): none holds
    the run's state. The members that do may still be on their way (the lighthouse formed a
    quorum before they asked): leave, and ask again."""


class ElasticWorker:
    """One member: its model, data and records across memberships, and the membership policy of
    the training loop (loop.py) for each membership."""

    def __init__(self, cfg: C.RunConfig, slot: int, membership: Membership, out_dir: Path | None, quiet: bool):
        # slot: this process's number for the launcher (a replica's processes: slot·K + rank; under
        # torchrun its rank in the job), by which the test faults name it
        self.cfg, self.slot, self.m, self.out_dir, self.quiet = cfg, slot, membership, out_dir, quiet
        self.device = pick_device(cfg, "gloo", 0)
        self.model = build_model(cfg, self.device)  # θ0 from the seed: alike on every worker, no collective
        self.model_reusable = True  # False once a run reshaped the model for its group (fsdp inside)
        data = load_tokens(cfg.data.source, cfg.data.val_fraction, cfg.data.vocab_size, quiet=True)
        self.train_tokens, self.val_tokens, self.source = data.train, data.val, data.label
        self.t: Trainer | None = None
        self.outputs: StepOutputs | None = None  # this membership's (rank 0's steps.jsonl, progress)
        self.snapshot: dict | None = None  # the state at the last commit point: {"step", "strategy", "log", "draws"}
        self.step = 0
        self.progress = Progress(Totals(cfg.workers))  # totals per slot, the wait since the first quorum
        self.joins_seen = 0
        self.since = 0  # the commit point before the last one (the test hold's window)
        self.view: View | None = None
        self.lead_log: str | None = None  # the quorum lead's steps.jsonl (_log_file)
        self.contributors: dict[int, int] = {}  # rank 0: outer sync step -> workers that contributed
        self.is_commit = support.commit_points(cfg)
        self.round = RoundState() if support.redoes_last_step(cfg) else None  # a failed sync redoes one step (rounds.py)
        # Kept across memberships, as a plain run's: the ring (a fault's events stay in it), the
        # trace (every membership's spans), the dashboards (opened when this member first leads).
        self.flight = FlightRecorder.for_rank(slot)
        self.tracer = Tracer(slot) if cfg.trace else None
        self.board = None
        self.fault: dict | None = None  # after a lost peer: the members before, the collective it failed in

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
            self._load(self.snapshot)
        else:  # the run's start: every member takes its snapshot (collective when sharded)
            # The first quorum of a resumed run. A member that comes to a later one (a replica that
            # missed the first: under torchrun they start apart) is behind its peers: it heals.
            if self.cfg.resume_from and not joining and max(view.steps) <= 0:
                self.progress.t_start -= checkpoints.load(self, view)
            self.snapshot = self._take_snapshot()
        healed = transfer.heal(view, lambda: self.snapshot, self._resume, self.t.run.levels[0].group)
        resumed = self._hash(self.snapshot)  # the committed state this member resumed from
        self.snapshot = self._take_snapshot(self.snapshot["log"])
        in_round = self.round.rejoin(self) if self.round is not None else None
        self._record(view, healed, resumed, in_round)
        return view

    def _build(self, view: View) -> None:
        """The run of this process on the quorum's group, assembled as a plain run's is
        (assemble.py): one worker a replica of its own, or a replica of K processes (replicas.py),
        whose cross-replica group (run.levels[0]: its position's ranks) is where it heals."""
        if self.t is not None:
            self.t.run.release()
        cfg = self.cfg
        if not self.model_reusable:  # θ0 again (the RNG left as it was): the state is loaded next
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.model = build_model(cfg, self.device)
        seat = Seat(view.rank, ReplicaLayout(view.world, view.world // view.size()), view.slots[view.rank])
        comm, levels = connect(cfg, seat, self.flight, member_timeout=support.member_timeout(cfg))
        run = strategy_run(cfg, self.model, comm, levels, seat, self.flight, self.tracer, self.device,
                           options=support.strategy_options(cfg), fault_rank=self.slot)
        support.configure(run, cfg)
        self.model_reusable = run.strategy.model_reusable
        self.view = view
        self.t = Trainer(cfg, view.rank, view.world, self.device, "gloo", comm, self.model, run,
                         loader_for(cfg, self.train_tokens, view, self.snapshot["draws"] if self.snapshot else 0),
                         val_for(cfg, self.val_tokens, view),
                         self.source, self.tracer, self.flight)

    def _joins_answered(self) -> int:
        """The announcements this quorum answered (a later one is news), alike on every member:
        the most any member has seen, so that all of them see the same news at a commit point."""
        every = [None] * self.view.world
        dist.all_gather_object(every, self.m.joins())
        return max(every)

    def _take_snapshot(self, log: dict | None = None) -> dict:
        """The state at a commit point, with `log`: the steps.jsonl records that commit made and
        the file they are due in (the quorum lead's). They travel with the state (transfer.heal),
        so the lead of the next quorum writes any the lead of this one did not: a commit is not
        atomic. After the gather the members still (a sharded state) gather the snapshot, a
        collective; a member can finish it while the lead fails in it or dies, and the step
        the others committed would have no record."""
        return {"step": self.step, "strategy": snapshot_of(self.t.run), "log": log or {"file": None, "records": []},
                "draws": self.t.loader.committed}

    def _load(self, snapshot: dict, joining: bool = False) -> None:
        """This member's state from a snapshot: its own, or (`joining`) a peer's, whose local
        parts it starts as a fresh worker would (contract/elastic.py)."""
        run = self.t.run
        state = run.strategy.as_joiner(snapshot["strategy"]) if joining else snapshot["strategy"]
        run.load_state_dict(run.strategy.member_state(state))
        if joining:
            run.strategy.join_from_peer()
        self.step = self.t.step = snapshot["step"]
        self.restart_data(snapshot.get("draws", 0))

    def restart_data(self, draws: int) -> None:
        """This member's data from draw `draws` of the run's stream on, as its membership deals it."""
        self.t.loader = loader_for(self.cfg, self.train_tokens, self.view, draws)

    def _resume(self, snapshot: dict) -> None:
        """Take a peer's newer committed state (transfer.heal), as a joiner."""
        self.snapshot = snapshot
        self._load(snapshot, joining=True)

    def _hash(self, snapshot: dict) -> str:
        return transfer.state_hash(self.t.run.strategy.replicated_state(snapshot["strategy"]))

    def _log_file(self) -> str | None:
        """This member's steps.jsonl, named across hosts. Under torchrun each job has its own --out,
        so a new lead in another job does not write what the last lead wrote into its own."""
        return None if self.out_dir is None else f"{socket.gethostname()}:{(self.out_dir / 'steps.jsonl').resolve()}"

    def _record(self, view: View, healed: list[int], resumed: str, in_round: int | None) -> None:
        """membership.jsonl (rank 0): the quorum, from which committed step (and, redoing a round's last step, the
        round step it went back to: rounds.py), who received the state, and each member's hash of
        the committed state all must hold alike (equal after a join), taken after the state was
        loaded into this membership, with the hash of the committed state each resumed from
        (equal to it: nothing lost in a transfer or a re-shard). After a fault: the members lost
        and, per survivor, the collective it was in when it found them gone (its flight ring)."""
        every, log_file = [None] * view.world, self._log_file()
        dist.all_gather_object(every, (self._hash(self.snapshot), resumed, log_file, self.fault))
        self.lead_log, self.fault = every[0][2], None  # where this quorum's records go
        self._open_outputs()
        if self.outputs.lead:
            faults = {view.slots[r]: e[3]["in"] for r, e in enumerate(every) if e[3] is not None}
            before = {s for e in every if e[3] is not None for s in e[3]["members"]}
            # lost: gone, or back already as a restarted process with nothing committed (-1)
            fresh = {slot for slot, step in zip(view.slots, view.steps) if step < 0}
            fault = {"fault": {"lost": sorted(before - (set(view.slots) - fresh)), "in": faults}} if faults else {}
            with open(self.out_dir / "membership.jsonl", "a") as f:
                f.write(json.dumps({"step": self.snapshot["step"], "round": in_round, "quorum": view.quorum, "slots": list(view.slots),
                                    "committed": list(view.steps), "healed": [view.slots[r] for r in healed],
                                    "state_sha256": [e[0] for e in every], "resumed_sha256": [e[1] for e in every],
                                    **fault, "time": time.time(), **view.described()}) + "\n")
            log = self.outputs.log  # a new lead continues the log
            due, logged = self.snapshot["log"], {r["step"] for r in log.kept}
            for record in due["records"] if due["file"] == log_file else ():
                if record["step"] not in logged:  # committed, but the last lead failed before writing it
                    log.write(record)
                    log.kept.append(record)
            p = self.progress
            p.totals, p.loss, p.val_loss = self.outputs.kept_totals(self.cfg.workers)
            self.contributors = {r["step"]: r["outer"]["contributors"] for r in log.kept if "outer" in r}

    def _open_outputs(self) -> None:
        """This membership's outputs: on its lead, steps.jsonl kept up to the committed step, the
        progress view, and the dashboards (this member's, opened when it first leads)."""
        if self.view.rank == 0 and self.board is None and self.out_dir is not None:
            from ..metrics.scalars import ScalarLogs
            self.board = ScalarLogs.for_run(self.cfg)
        self.outputs = StepOutputs(self.t, self.out_dir, self.quiet, continues_after=self.snapshot["step"],
                                   board=self.board if self.view.rank == 0 else None)

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
        commit_position(t.loader)  # the data stream's, recorded in the snapshot
        self.snapshot = self._take_snapshot({"file": self.lead_log, "records": records})
        note_commit_if_asked(self.slot, self.step, lambda: self._hash(self.snapshot))  # test-only
        if self.round is not None:
            self.round.forget()
        kill_if_asked(self.view.rank, self.step, "KILL_BEFORE_LOG")  # test-only

    def save(self, t, wall_s: float) -> None:
        """The members of this quorum, at this commit point (checkpoints.py)."""
        checkpoints.write(self, wall_s)

    def leaves(self, step: int, joins: int) -> bool:
        """Re-form for a joiner that has announced itself. One waiting at the last commit point is
        not taken in: there is nothing left to train (it would finish the run as a member that
        trained nothing, counted in the summary)."""
        joins = max(joins, hold_for_joiner_if_asked(step, self.m, self.joins_seen, self.since))
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

    def stop(self) -> None:
        """--stop-at, or a stop asked by a signal: the checkpoint is written; this part of the run
        ends without summary.json (the loop said how to continue it)."""
        self.t.run.release()
        run_end.gather_trace(self.t, self.out_dir if self.t.rank == 0 else None, stopped_after_step=self.step)
        self._close_board()

    def finish(self, result: LoopResult) -> None:
        t = self.t
        t.run.close()  # collective: every member ends on the same final parameters
        final = transfer.state_hash({f"model.{k}": v for k, v in self.model.state_dict().items()})
        every = [None] * self.view.world
        dist.all_gather_object(every, final)
        summary = run_end.summarize(t, result, self.out_dir if t.rank == 0 else None, self.quiet)
        if summary is not None and self.out_dir is not None:
            from ..metrics.runlog import write_json_atomic
            summary["elastic"] = {"members": list(self.view.slots), "final_params_sha256": every,
                                  "min_workers": support.min_workers(self.cfg),
                                  **({"contributors_per_outer_sync": self.contributors} if self.contributors else {})}
            write_json_atomic(self.out_dir / "summary.json", summary)
        self._close_board()

    def _close_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None


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
            result = loop(w.t, w.outputs, w, w.progress)
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
        if failed:
            # Out of the except block: its traceback holds the broken group (DDP's reducer, c10d's
            # frames), and a group still held keeps its sockets open through destroy_process_group,
            # so a survivor blocked on this member waited --member-timeout instead of failing at once.
            w.rollback()
        reforms += 1  # a re-form: for a joiner, or after a failure
        if failed:
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


def elastic_entry(_i: int, slot: int, cfg: C.RunConfig, store_port: int, lighthouse_address: str,
                  out_dir: str | None, quiet: bool, joining: bool) -> None:
    """Entry of an elastic worker the launcher started (or restarted, `joining`)."""
    m = Membership(lighthouse_address, "127.0.0.1", store_port, slot, support.member_timeout(cfg),
                   speaks=slot == 0, quorum_timeout_s=cfg.quorum_timeout)  # speaks: one line, not one a worker
    ask_checkpoint_on_sigterm(cfg)
    try:
        run_elastic(cfg, slot, m, Path(out_dir) if out_dir else None, quiet, joining)
    finally:
        m.close()

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
from that step, each on the data its new rank and the new world size give (see `loader_for`).
A joiner (a restarted worker, or one more from `lowcomm join`) asks for a quorum as soon as it
has built its model; the members notice its announcement at their next commit point and re-form
with it. Checkpoints are written at commit points, and a resumed run loads one at its first
quorum (checkpoints.py).
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import config as C
from . import run_end
from ..data import load_bytes, split, val_batches
from ..data.loader import ShardedBatches
from ..errors import RunError
from .faults import hold_for_joiner_if_asked, kill_if_asked
from ..metrics.runlog import StepLog, result_vector, step_record
from ..metrics.summary import Totals
from ..models import lm_loss
from .worker import LoopResult, Trainer, build_model, evaluate, pick_device
from ..elastic import checkpoints, support, transfer
from . import replica_run
from .rounds import RoundState, snapshot_of
from ..elastic.membership import Membership, View, leave

MAX_REFORMS_WITHOUT_PROGRESS = 20  # re-forming again and again without a commit: give up, one line


def loader_for(cfg: C.RunConfig, train, view: View, step: int) -> ShardedBatches:
    """The data of rank `view.rank` of `view.world` from `step` on: the training split is cut in
    world shards, each read in an order drawn from (seed, step the membership began, rank). So
    what a worker trains on is a function of the step and the live membership (membership.jsonl
    records both); the steps a failure discarded are trained again by the new membership on its
    own data (re-assigned, not skipped)."""
    rank, world, position, positions = view.shard()  # a replica of K processes: its shard, split K ways
    return ShardedBatches(train, rank, world, cfg.model.seq_len, cfg.loader_micro_batch,
                          cfg.seed * 1_000_003 + step, position, positions)


def val_for(cfg: C.RunConfig, val_tokens, view: View) -> list:
    """This member's share of the run's validation batches, which are the same whatever the
    membership: those a run of --workers ranks evaluates, dealt round-robin to the members (a
    member beyond them evaluates none). So validation losses compare across memberships and with
    a fault-free run; each member's share of a W-member quorum's set would be another sample."""
    ranks = cfg.workers
    return [batch for r in range(view.rank, ranks, view.world)
            for batch in val_batches(val_tokens, r, ranks, cfg.model.seq_len, cfg.micro_batch, cfg.eval_batches)]


class ElasticWorker:
    def __init__(self, cfg: C.RunConfig, slot: int, membership: Membership, out_dir: Path | None, quiet: bool):
        self.cfg, self.slot, self.m, self.out_dir, self.quiet = cfg, slot, membership, out_dir, quiet
        self.device = pick_device(cfg, "gloo", 0)
        self.model = build_model(cfg, self.device)  # θ0 from the seed: alike on every worker, no collective
        tokens, self.source = load_bytes(cfg.data.source, quiet=True)
        self.train_tokens, self.val_tokens = split(tokens, cfg.data.val_fraction)
        self.t: Trainer | None = None
        self.snapshot: dict | None = None  # the state at the last commit point: {"step", "strategy"}
        self.step = 0
        self.totals = Totals(cfg.workers)  # per slot
        self.loss = self.val_loss = float("nan")
        self.joins_seen = 0
        self.view: View | None = None
        self.t_start = time.perf_counter()  # less the earlier parts' wall time in a resumed run
        self.log: StepLog | None = None  # rank 0's steps.jsonl
        self.lead_log: str | None = None  # the quorum lead's steps.jsonl (_log_file)
        self.contributors: dict[int, int] = {}  # rank 0: outer sync step -> workers that contributed
        self.pending: list[torch.Tensor] = []  # this member's records of the steps since the last commit
        self.is_commit = support.commit_points(cfg)
        self.round = RoundState() if support.redoes_last_step(cfg) else None  # a failed sync redoes one step (rounds.py)

    # -- membership ---------------------------------------------------------------------
    def form(self, joining: bool) -> View:
        """A quorum, its group, a run on it, and every member on the newest committed state."""
        committed = self.snapshot["step"] if self.snapshot is not None else (-1 if joining else 0)
        view = self.m.agree(committed, joining=joining)
        if view is self.view and self.t is not None:  # the same members on the same group (replicas.py)
            self.joins_seen = self._joins_answered()
            return view
        self._build(view)
        self.joins_seen = self._joins_answered()
        if self.snapshot is not None:
            self._load(self.snapshot)
        else:  # the run's start: every member takes its snapshot (collective when sharded)
            if self.cfg.resume_from and not joining:  # the first quorum of a resumed run
                self.t_start -= checkpoints.load(self, view)
            self.snapshot = self._take_snapshot()
        healed = transfer.heal(view, lambda: self.snapshot, self._resume, self.t.run.levels[0].group)
        resumed = self._hash(self.snapshot)  # the committed state this member resumed from
        self.snapshot = self._take_snapshot(self.snapshot["log"])
        in_round = self.round.rejoin(self) if self.round is not None else None
        self._record(view, healed, resumed, in_round)
        return view

    def _build(self, view: View) -> None:
        if self.t is not None:
            self.t.run.release()
        self.t = replica_run.build(self, view)  # one worker a replica, or a replica of K processes
        self.view = view

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
        atomic. After the gather the members still evaluate and (a sharded state) gather the snapshot, both
        collectives; a member can finish them while the lead fails in them or dies, and the step
        the others committed would have no record."""
        return {"step": self.step, "strategy": snapshot_of(self.t.run), "log": log or {"file": None, "records": []}}

    def _load(self, snapshot: dict, joining: bool = False) -> None:
        """This member's state from a snapshot: its own, or (`joining`) a peer's, whose local
        parts it starts as a fresh worker would (contract/elastic.py)."""
        run = self.t.run
        state = run.strategy.as_joiner(snapshot["strategy"]) if joining else snapshot["strategy"]
        run.load_state_dict(run.strategy.member_state(state))
        if joining:
            run.strategy.join_from_peer()
        self.step = self.t.step = snapshot["step"]
        self.restart_data()

    def restart_data(self) -> None:
        """This member's data from self.step on, as its membership gives it."""
        self.t.loader = loader_for(self.cfg, self.train_tokens, self.view, self.step)

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
        (equal to it: nothing lost in a transfer or a re-shard)."""
        every, log_file = [None] * view.world, self._log_file()
        dist.all_gather_object(every, (self._hash(self.snapshot), resumed, log_file))
        self.lead_log = every[0][2]  # where this quorum's records go
        if self.log is not None:
            self.log.close()
            self.log = None
        if view.rank == 0 and self.out_dir is not None:
            with open(self.out_dir / "membership.jsonl", "a") as f:
                f.write(json.dumps({"step": self.snapshot["step"], "round": in_round, "quorum": view.quorum, "slots": list(view.slots),
                                    "committed": list(view.steps), "healed": [view.slots[r] for r in healed],
                                    "state_sha256": [e[0] for e in every], "resumed_sha256": [e[1] for e in every],
                                    "time": time.time(), **view.described()}) + "\n")
            self.log = StepLog(self.out_dir, resume_after=self.snapshot["step"])  # a new lead continues the log
            due, logged = self.snapshot["log"], {r["step"] for r in self.log.kept}
            for record in due["records"] if due["file"] == log_file else ():
                if record["step"] not in logged:  # committed, but the last lead failed before writing it
                    self.log.write(record)
                    self.log.kept.append(record)
            self.totals = Totals(self.cfg.workers)
            for record in self.log.kept:
                self._add(record)
            self.contributors = {r["step"]: r["outer"]["contributors"] for r in self.log.kept if "outer" in r}

    # -- training -----------------------------------------------------------------------
    def train_until_commit_or_change(self) -> bool:
        """Train to the end or to a commit point where a joiner waits. True at the end."""
        cfg, t = self.cfg, self.t
        while self.step < checkpoints.end_step(cfg):
            self.m.progress()
            if self.round is not None and self.is_commit(self.step + 1):
                self.round.keep(self)
            self.pending.append(result_vector(t.run.step(t.next_batch, lm_loss)))
            self.step = t.step = self.step + 1
            if not self.is_commit(self.step):
                continue
            joins = max(self._commit(self.pending), hold_for_joiner_if_asked(self.step, self.m, self.joins_seen))
            self.pending = []
            if self.round is not None:
                self.round.forget()
            # A joiner waiting at the last commit point is not taken in: there is nothing left to
            # train (it would finish the run as a member that trained nothing, counted in the summary).
            if joins > self.joins_seen and self.step < checkpoints.end_step(cfg):
                return False
        return True

    def _commit(self, pending: list) -> int:
        """Gather the records since the last commit (every member finished those steps), write
        them, evaluate when due, keep the snapshot. Returns the most joins any member has seen."""
        t, cfg = self.t, self.cfg
        flags = torch.zeros(len(pending[0]), dtype=torch.float64)
        flags[0] = self.m.joins()
        every = t.comm.meta_all_gather(torch.stack(pending + [flags])).cpu()
        first = self.step - len(pending) + 1
        records = [step_record(first + i, every[:, i], len(t.run.levels) > 1) for i in range(len(pending))]
        now = time.time()  # when the step was committed (bench/chaos.py times recoveries by it)
        for r in records:
            r["members"], r["committed_at"] = list(self.view.slots), now
        outer = support.outer_record(t.run)
        if outer is not None:  # an outer sync: who contributed to it, and how much
            records[-1]["outer"] = outer
            self.contributors[self.step] = outer["contributors"]
        if (cfg.eval_every and self.step % cfg.eval_every == 0) or self.step == cfg.steps:
            with t.run.evaluating() as eval_model:
                self.val_loss = records[-1]["val_loss"] = evaluate(eval_model, t.val, t.comm, t.device)
        self.snapshot = self._take_snapshot({"file": self.lead_log, "records": records})
        kill_if_asked(self.view.rank, self.step, "KILL_BEFORE_LOG")  # test-only
        for r in records:
            self._add(r)
            if self.log is not None:
                self.log.write(r)
        self.loss = records[-1]["loss"]
        if checkpoints.due(cfg, self.step):  # the members of this quorum, at this commit point
            checkpoints.write(self, time.perf_counter() - self.t_start)
        if self.log is not None and not self.quiet:
            print(f"step {self.step}/{cfg.steps} loss {self.loss:.4f} on {self.view.world} worker(s)", flush=True)
        return int(every[:, -1, 0].max())

    def _add(self, record: dict) -> None:
        """Totals per slot: a record's per-rank values go to the slots of its members."""
        slots = record.get("members") or list(range(len(record["per_rank"]["micro_batches"])))
        grow(self.totals, max(slots) + 1)  # a joiner's slot is W or above (lowcomm join)
        padded = {k: [0] * len(self.totals.micro_per_rank) for k in record["per_rank"]}
        for rank, slot in enumerate(slots):
            for k, values in record["per_rank"].items():
                padded[k][slot] = values[rank]
        self.totals.add({**record, "per_rank": padded})

    def rollback(self) -> None:
        """A collective failed: forget the run on the broken group and the steps since the snapshot."""
        if self.t is not None:
            self.t.run.release()
            self.t = None  # DDP's reducer holds the group: let it go with the run
        if self.log is not None:
            self.log.close()
            self.log = None
        # Destroy the broken group now, not after the next quorum: its sockets close, so a survivor
        # still blocked in the failed collective (waiting on this member, not on the dead one)
        # fails at once instead of after --timeout, and joins the quorum too.
        leave()
        self.step = self.snapshot["step"] if self.snapshot is not None else 0
        self.pending = []  # a round state (rounds.py) may bring back those of the round

    def stop(self) -> None:
        """--stop-at: the checkpoint is written; this part of the run ends without summary.json."""
        self.t.run.release()
        if self.log is not None:
            self.log.close()
            if not self.quiet:
                print(f"lowcomm: stopped after step {self.step} of {self.cfg.steps} with a checkpoint; continue "
                      f"with: lowcomm train --resume {self.out_dir}", flush=True)

    def finish(self) -> None:
        t = self.t
        t.run.close()  # collective: every member ends on the same final parameters
        if self.log is not None:
            self.log.close()
        final = transfer.state_hash({f"model.{k}": v for k, v in self.model.state_dict().items()})
        every = [None] * self.view.world
        dist.all_gather_object(every, final)
        result = LoopResult(self.totals, self.loss, self.val_loss, time.perf_counter() - self.t_start)
        summary = run_end.summarize(t, result, self.out_dir if t.rank == 0 else None, self.quiet)
        if summary is not None and self.out_dir is not None:
            from ..metrics.runlog import write_json_atomic
            summary["elastic"] = {"members": list(self.view.slots), "final_params_sha256": every,
                                  "min_workers": support.min_workers(self.cfg),
                                  **({"contributors_per_outer_sync": self.contributors} if self.contributors else {})}
            write_json_atomic(self.out_dir / "summary.json", summary)


def grow(totals: Totals, slots: int) -> None:
    """Per-slot totals for `slots` slots at least."""
    for name in ("compute_per_rank", "exposed_per_rank", "micro_per_rank"):
        values = getattr(totals, name)
        values.extend([0] * (slots - len(values)))


def run_elastic(cfg: C.RunConfig, slot: int, membership: Membership, out_dir: Path | None, quiet: bool,
                joining: bool) -> ElasticWorker:
    """One elastic worker's life, from its first quorum to the end of the run (the worker, ended)."""
    torch.set_num_threads(cfg.threads)
    w = ElasticWorker(cfg, slot, membership, out_dir, quiet)
    if not joining:
        membership.wait_for_first(cfg.workers)
    w.t_start = time.perf_counter()
    reforms = 0
    while True:
        failed = False
        try:
            w.form(joining)
            joining = False
            committed = w.step
            if w.train_until_commit_or_change():
                break
            reforms = 0 if w.step > committed else reforms + 1
        except RuntimeError as e:  # gloo: a peer closed the connection (died), or a collective timed out
            if not lost_peer(e):
                raise
            failed = True
        if failed:
            # Out of the except block: its traceback holds the broken group (DDP's reducer, c10d's
            # frames), and a group still held keeps its sockets open through destroy_process_group,
            # so a survivor blocked on this member waited --member-timeout instead of failing at once.
            w.rollback()
            reforms += 1
            # Announce ourselves as a joiner would: if we were the one cut off (frozen past
            # --member-timeout, then continued), the members went on without us and ask for a
            # quorum again only when told; if we are a survivor, the announcement is in the count
            # the new quorum agrees on (_joins_answered), so it costs nothing.
            joining = True
        if reforms > MAX_REFORMS_WITHOUT_PROGRESS:
            raise RunError(f"the group changed {reforms} times without committing a step; giving up")
    if w.step < cfg.steps:  # --stop-at
        w.stop()
    else:
        w.finish()
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
                   speaks=slot == 0)  # one line for a quorum long in coming, not one a worker
    try:
        run_elastic(cfg, slot, m, Path(out_dir) if out_dir else None, quiet, joining)
    finally:
        m.close()

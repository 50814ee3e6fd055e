"""What an elastic member keeps across its memberships, as a plain rank keeps it for its run: its
device and model (θ0 from the seed, no collective), the data's tokens (each membership deals it
its draws of the run's stream: member_data.py), its progress, the flight recorder (a fault's
events stay in it), the tracer (every membership's spans) and the dashboards (opened when it first
leads); each membership's outputs (outputs.StepOutputs, as a plain run's) and the run's end
(run_end: summary.json written once, with the members' `elastic` block). What changes membership
-- form, heal, roll back, commit -- is train/elastic.py's ElasticWorker, built on this."""
from __future__ import annotations

import socket
from pathlib import Path

import torch

from .. import config as C
from . import run_end
from ..comm.flight import FlightRecorder
from ..comm.groups import ReplicaLayout
from ..comm.objects import all_gather_object
from ..contract.parts import replicated_tensors
from ..contract.replica import model_reusable
from ..data import load_tokens
from ..diagnose.trace import Tracer
from ..elastic import support, transfer
from ..elastic.membership import Membership, View
from ..metrics.summary import Totals
from .assemble import Seat, Trainer, build_trainer
from .loop import LoopResult, Progress
from .member_data import loader_for, val_for
from .outputs import StepOutputs
from .rounds import RoundState
from ..models import build_run_model
from .worker import pick_device


class MemberLife:
    """One elastic member's life across memberships (module docstring)."""

    def __init__(self, cfg: C.RunConfig, slot: int, membership: Membership, out_dir: Path | None, quiet: bool):
        # slot: this process's number for the launcher (a replica's processes: slot·K + rank; under
        # torchrun its rank in the job), by which the test faults name it
        self.cfg, self.slot, self.m, self.out_dir, self.quiet = cfg, slot, membership, out_dir, quiet
        self.device = pick_device(cfg, "gloo", 0)
        self.model = build_run_model(cfg, self.device)  # θ0 from the seed: alike on every worker, no collective
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

    def _build(self, view: View) -> None:
        """The run of this process on the quorum's group, assembled as a plain run's is
        (assemble.py): one worker a replica of its own, or a replica of K processes (replicas.py),
        whose cross-replica group (run.levels[0]: its position's ranks) is where it heals."""
        if self.t is not None:
            self.t.run.release()
        cfg = self.cfg
        if not self.model_reusable:  # θ0 again (the RNG left as it was): the state is loaded next
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.model = build_run_model(cfg, self.device)
        seat = Seat(view.rank, ReplicaLayout(view.world, view.world // view.size()), view.slots[view.rank])
        draws = self.snapshot["draws"] if self.snapshot else 0
        self.t = build_trainer(cfg, seat, self.device, "gloo", lambda: self.model,
                               lambda: (loader_for(cfg, self.train_tokens, view, draws), val_for(cfg, self.val_tokens, view),
                                        self.source),
                               self.flight, self.tracer, member_timeout=support.member_timeout(cfg),
                               options=support.strategy_options(cfg), fault_rank=self.slot)
        K = view.size()  # a replica of K processes is slots s·K .. s·K + K - 1 (replicas.py): replica s
        support.configure(self.t.run, cfg, tuple(s // K for s in view.slots[::K]))
        self.model_reusable = model_reusable(self.t.run.strategy)
        self.view = view

    def restart_data(self, draws: int) -> None:
        """This member's data from draw `draws` of the run's stream on, as its membership deals it."""
        self.t.loader = loader_for(self.cfg, self.train_tokens, self.view, draws)

    def hash_of(self, snapshot: dict) -> str:
        """The hash of a snapshot's replicated state (membership.jsonl's state_sha256)."""
        return transfer.state_hash(replicated_tensors(self.t.run.strategy.state_parts(), snapshot["strategy"]))

    def _log_file(self) -> str | None:
        """This member's steps.jsonl, named across hosts. Under torchrun each job has its own --out,
        so a new lead in another job does not write what the last lead wrote into its own."""
        return None if self.out_dir is None else f"{socket.gethostname()}:{(self.out_dir / 'steps.jsonl').resolve()}"

    def _open_outputs(self) -> None:
        """This membership's outputs: on its lead, steps.jsonl kept up to the committed step, the
        progress view, and the dashboards (this member's, opened when it first leads)."""
        if self.view.rank == 0 and self.board is None and self.out_dir is not None:
            from ..metrics.scalars import ScalarLogs
            self.board = ScalarLogs.for_run(self.cfg)
        self.outputs = StepOutputs(self.t, self.out_dir, self.quiet, continues_after=self.snapshot["step"],
                                   board=self.board if self.view.rank == 0 else None)

    def stop(self) -> None:
        """--stop-at, or a stop asked by a signal: the checkpoint is written; this part of the run
        ends without summary.json (the loop said how to continue it)."""
        run_end.stop(self.t, self.out_dir)
        self._close_board()

    def finish(self, result: LoopResult) -> None:
        """The run's end: summary.json (run_end.finish) with the members and their final parameters' hashes."""
        run_end.finish(self.t, result, self.out_dir, self.quiet, extra=self._summary)
        self._close_board()

    def _summary(self) -> dict:
        """summary.json's `elastic` (collective, after the strategy closed: every member's final hash)."""
        final = transfer.state_hash({f"model.{k}": v for k, v in self.model.state_dict().items()})
        every = all_gather_object(self.t.comm, final)
        heals = transfer.heal_totals(self.out_dir / "membership.jsonl") if self.out_dir is not None else None
        return {"elastic": {"members": list(self.view.slots), "final_params_sha256": every,
                            "min_workers": support.min_workers(self.cfg),
                            **({"contributors_per_outer_sync": self.contributors} if self.contributors else {}),
                            "heals": heals}}

    def _close_board(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None

"""Where each gathered step goes: rank 0's steps.jsonl, progress view and flags (stragglers, slow
link, loss spikes, the launcher's stalled collectives), --score's rounds (on the records of the steps
that scored, and a worker left out or taken back on the progress line), and the dashboards asked for
(--tensorboard, --wandb). The training loop (loop.py) hands records over; this module knows where
they are written."""
from __future__ import annotations

from pathlib import Path

from ..engines.outer_scoring import OuterScoring
from ..engines.outer_sync import OuterSync
from ..metrics.progress import ProgressView
from ..metrics.runlog import StepLog
from ..metrics.scalars import ScalarLogs
from ..diagnose.slowlink import SlowLinkFlags
from ..diagnose.spikes import LossSpikeFlags, is_spike
from ..diagnose.stalls import StallFlags
from ..diagnose.stragglers import StragglerFlags
from ..metrics.summary import Totals


class StepOutputs:
    """Rank 0's outputs of a run (`lead`: it writes a run directory); the others hold none."""

    def __init__(self, t, out_dir: Path | None, quiet: bool, continues_after: int | None = None,
                 board: ScalarLogs | None | bool = True):
        """`continues_after`: the log keeps the records up to that step (an elastic run's new
        membership; default: a resumed run's step). `board`: the dashboards, opened here on rank 0
        (True), or kept by the caller across memberships and not closed here."""
        cfg = t.cfg
        self.lead, self.quiet = t.rank == 0 and out_dir is not None, quiet
        self.levels = t.run.levels
        if continues_after is None and cfg.resume_from:
            continues_after = t.step
        self.log = StepLog(out_dir, resume_after=continues_after) if self.lead else None
        leveled = len(self.levels) > 1  # replica groups: bytes and waits shown per level
        self.view = ProgressView(cfg.steps, f"{cfg.strategy} W={t.world}", enabled=self.lead and not quiet,
                                 levels=leveled, local_models=isinstance(getattr(t.run.strategy, "sync", None), OuterSync))
        self.stragglers = StragglerFlags() if self.lead else None
        self.slow_link = SlowLinkFlags() if self.lead else None
        self.spikes = LossSpikeFlags() if self.lead else None
        self._shown_late: list[str] = []  # spikes of a gather's earlier steps, for its progress line
        self.stalls = StallFlags.for_run() if self.lead else None  # None without lowcomm's launcher
        self._owns_board = board is True
        if board is True:  # optional extras, checked before the run
            board = ScalarLogs.for_run(cfg) if t.rank == 0 else None
        self.board = board or None
        self.loader_s = t.loader_s  # the trainer's reading time per step (Trainer.next_batch)
        strategy = t.run.strategy  # --score's rounds: the outer-sync engine's, or a per-step strategy's own (DeMo)
        scoring = getattr(strategy, "scoring", None) or getattr(getattr(strategy, "sync", None), "scoring", None)
        self.scores = ScoreRounds(scoring, self.log.kept, cfg.end_step) if self.lead and scoring else None
        self._standing: list[str] = []  # --score: workers left out or taken back in a gather's steps

    def kept_totals(self, world: int) -> tuple[Totals, float, float]:
        """The totals, last loss and last validation loss of the steps before a resumed checkpoint."""
        totals, loss, val_loss = Totals(world), float("nan"), float("nan")
        for record in (self.log.kept if self.log is not None else []):
            if "members" not in record and len(record["per_rank"]["micro_batches"]) != world:  # resumed on another world size
                record = {**record, "per_rank": {k: [0] * world for k in record["per_rank"]}}
            totals.add(record)
            loss, val_loss = record["loss"], record.get("val_loss", val_loss)
        return totals, loss, val_loss

    def write(self, records: list[dict], totals: Totals) -> None:
        """The steps' records into the totals and the logs (the flags first: they go in the record)."""
        if self.scores is not None and records:
            self._standing = self.scores.place(records)
        for record in records:
            totals.add(record)
            loader_s = self.loader_s.pop(record["step"], 0.0)
            if self.lead:
                record["loader_s"] = round(loader_s, 6)
                self.flag(record)
                self.log.write(record)
        for step in [s for s in self.loader_s if records and s <= records[-1]["step"]]:
            del self.loader_s[step]  # steps an elastic membership trained and lost: redone, timed anew
        # The progress line shows a gather's last step; a spike is one step's, so an earlier
        # one is named with its step there (steps.jsonl has it on its own record).
        self._shown_late = [f"step {r['step']}: {f}" for r in records[:-1] for f in r.get("flags", ()) if is_spike(f)]
        if self.board is not None:
            self.board.write(records, {c.level: c.snapshot().wire_bytes for c in self.levels})

    def flag(self, record: dict) -> None:
        """Every analysis' flags of this step, together in the record's `flags`."""
        found = self.spikes.flags(record) + self.stragglers.flags(record) + self.slow_link.flags(record)
        if self.stalls is not None:
            found += self.stalls.flags(record)
        if found:
            record["flags"] = found

    def show(self, step: int, totals: Totals, last: dict, elapsed: float) -> None:
        if self.lead:
            self.view.update(step, last["loss"], totals.tokens / elapsed, totals.wire / 1e6, totals.exposed / elapsed,
                             last.get("val_loss"), totals.per_level(step, elapsed),
                             self._shown_late + last.get("flags", []) + self._standing)

    def close(self) -> None:
        self.view.close()
        if self.log is not None:
            self.log.close()
        if self.board is not None and self._owns_board:
            self.board.close()


class ScoreRounds:
    """Rank 0's placing of --score's rounds (engines/outer_scoring.py, alike on every worker) on
    the records of steps.jsonl: each round on the record of the step whose outer step took it
    (`score_rounds`, a list: a streaming run's fragments and the final sync score several rounds
    in one step), a round of unknown step (the final sync's) on the last record gathered, and at
    the run's last step every round left. A resumed run goes on after the last round its kept
    records hold."""

    def __init__(self, scoring: OuterScoring, kept: list[dict], end_step: int):
        self.scoring, self.end_step = scoring, end_step
        self.next = 1 + max((k["round"] for r in kept for k in r.get("score_rounds", ())), default=-1)
        self.waiting: list[tuple[int | None, dict]] = []  # rounds due at a step not gathered yet

    def place(self, records: list[dict]) -> list[str]:
        """The rounds scored up to these records' last step into them -> what the progress line
        says of them ('round 4: worker 2 left out: its score was negative for 3 rounds')."""
        new = self.scoring.rounds_from(self.next)
        self.next += len(new)
        placed, self.waiting = self.waiting + new, []
        ends = records[-1]["step"] >= self.end_step
        said = []
        for step, entry in placed:
            target = records[-1] if step is None else next((r for r in records if r["step"] >= step), None)
            if target is None and not ends:
                self.waiting.append((step, entry))
                continue
            (target or records[-1]).setdefault("score_rounds", []).append(entry)
            said += [f"round {entry['round']}: {e}" for e in self.scoring.standing_changes(entry)]
        return said

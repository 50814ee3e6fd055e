"""The training loop: the only one. A plain run and an elastic run both train here; what differs
is their membership, a policy the loop asks at four points (`Members`):

  start        before the first step of a membership (a plain run: a barrier, then the training
               timeout; an elastic run: nothing, its quorum has just formed)
  gathers_at   whether a step ends at a gather (a plain run: every --log-every, evaluation,
               checkpoint and the last step; an elastic run: its strategy's commit points only,
               since a gathered record is a committed step, written once and never redone)
  committed    the gathered (and evaluated) records are the members' agreement (an elastic run:
               they carry the members and the outer merge's contributors, and each member keeps
               its snapshot, the state it goes back to when a peer is lost)
  leaves       after a gather, whether to leave the loop for a new membership (a joiner waits)

Everything else -- bad steps (--max-bad-steps), evaluation, steps.jsonl, the dashboards
(--tensorboard, --wandb), the progress view, checkpoints, a stop asked by a signal -- is the
loop's, alike for both.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from ..checkpoint import take_request as take_checkpoint_request
from ..comm.flight import recorded
from ..errors import BadSteps, RunError
from ..metrics.runlog import result_vector, step_record
from ..metrics.summary import Totals
from ..models import lm_loss


@dataclass
class LoopResult:
    totals: Totals
    train_loss: float
    val_loss: float
    wall_s: float
    stopped: bool = False  # ended before cfg.steps (--stop-at, or a stop asked for): no summary yet


@dataclass
class Progress:
    """What the run has done so far; an elastic run keeps it across its memberships."""
    totals: Totals
    loss: float = float("nan")
    val_loss: float = float("nan")
    bad_in_row: int = 0  # consecutive bad steps (--max-bad-steps)
    t_start: float = field(default_factory=time.perf_counter)  # less the wall time of earlier parts
    pending: list = field(default_factory=list)  # this rank's results of the steps not yet gathered
    # validation losses of steps not yet gathered (an elastic run evaluates between commit points)
    evaluated: dict = field(default_factory=dict)

    def forget_after(self, step: int) -> None:
        """Back to `step` (an elastic run's rollback): the later steps' results are redone."""
        self.evaluated = {s: v for s, v in self.evaluated.items() if s <= step}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


class FixedMembers:
    """A plain run's membership: the ranks that started it, for the whole run."""

    def __init__(self, cfg):
        self.cfg = cfg

    def start(self, t) -> None:
        # Start the clocks together: a rank that finished set-up early must not count
        # its wait for the others in step 1 as exposed communication.
        t.comm.barrier()
        use_training_timeout(self.cfg)

    def gathers_at(self, step: int, due: bool) -> bool:
        return due

    def before_step(self, t, progress: Progress) -> None:
        pass

    def joins(self) -> int:
        return 0

    def committed(self, t, records: list[dict]) -> None:
        pass

    def save(self, t, wall_s: float) -> None:
        from ..checkpoint import save
        save(t, Path(self.cfg.out), self.cfg.keep, wall_s=wall_s)

    def leaves(self, step: int, joins: int) -> bool:
        return False


def loop(t, outputs, members, progress: Progress) -> LoopResult | None:
    """Train up to cfg.steps (or --stop-at) steps; rank 0 logs every gathered step and shows
    progress. Checkpoints (every --checkpoint-every steps, or an elastic run's first commit point
    after each multiple; at the end, at --stop-at, or when asked through checkpoint.request())
    are written at gathers, after the steps' records. Returns None when the membership asks to
    change (the caller forms the new one and calls again)."""
    cfg, run = t.cfg, t.run
    end = cfg.end_step
    every = cfg.checkpoint_every
    if (every or cfg.stop_at or cfg.checkpoint_on_signal) and not cfg.out:
        raise RunError("checkpoints need the output directory on every rank: pass --out (under torchrun too)")
    members.start(t)
    # The next checkpoint: at the first gather at or after each multiple of --checkpoint-every (a
    # plain run gathers at the multiple itself; an elastic run's commit points may fall between).
    def next_checkpoint(step: int) -> int:
        return (step // every + 1) * every if every else 0
    checkpoint_at = next_checkpoint(t.step)
    stopped = False
    try:
        while t.step < end:
            members.before_step(t, progress)
            progress.pending.append(result_vector(run.step(t.next_batch, lm_loss)))
            t.step += 1
            step = t.step
            evaluate_now = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
            checkpoint_now = bool(every and step >= checkpoint_at) or (step == end and bool(every or cfg.stop_at))
            if not members.gathers_at(step, evaluate_now or checkpoint_now or step == end or step % cfg.log_every == 0):
                if evaluate_now:  # between an elastic run's commit points: evaluated now, written at the commit
                    progress.evaluated[step] = evaluate_run(t)
                continue
            records, asked, stop_asked, joins = gather_records(t, progress.pending, members.joins())
            progress.bad_in_row = check_steps(records, progress.bad_in_row, cfg.max_bad_steps, outputs.lead, outputs.log,
                                              scaled=cfg.precision == "fp16")
            if evaluate_now:
                progress.evaluated[step] = evaluate_run(t)
            for r in records:
                if r["step"] in progress.evaluated:
                    progress.val_loss = r["val_loss"] = progress.evaluated.pop(r["step"])
            members.committed(t, records)
            outputs.write(records, progress.totals)
            progress.loss = records[-1]["loss"]
            if checkpoint_now or asked:
                with recorded(t.flight, "checkpoint"):
                    members.save(t, progress.elapsed())
                checkpoint_at = next_checkpoint(step)
            outputs.show(step, progress.totals, records[-1], progress.elapsed())
            if stop_asked and step < cfg.steps:
                stopped = True
                break
            if members.leaves(step, joins):
                return None
    finally:
        outputs.close()
    stopped = stopped or t.step < cfg.steps
    if outputs.lead and stopped and not outputs.quiet:
        print(f"lowcomm: stopped after step {t.step} of {cfg.steps} with a checkpoint; continue with: "
              f"lowcomm train --resume {cfg.out}", flush=True)
    return LoopResult(progress.totals, progress.loss, progress.val_loss, progress.elapsed(), stopped)


def evaluate_run(t) -> float:
    """The validation loss of what the strategy evaluates (DiLoCo: θ_global), over every rank."""
    with recorded(t.flight, "evaluate"), t.run.evaluating() as eval_model, t.run.autocast():  # --precision
        return evaluate(eval_model, t.val, t.comm, t.device)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, comm, device) -> float:
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        total[0] += float(lm_loss(model, (x.to(device), y.to(device)))) * x.shape[0]
        total[1] += x.shape[0]
    model.train(was_training)
    comm.meta_all_reduce(total)
    return float(total[0] / total[1])


def gather_records(t, pending: list[torch.Tensor], joins: int = 0) -> tuple[list[dict], bool, bool, int]:
    """Every rank's results of the steps since the last gather, merged into step records; with
    them every rank's checkpoint and stop requests, so all ranks agree on them, and the most
    joiners any member has seen announce themselves (an elastic run). Gathering is a sync point,
    so it happens every --log-every steps, not every step: a fast worker of an adaptive strategy
    must not idle waiting for a slow one's log line."""
    flags = torch.zeros(len(pending[0]), dtype=torch.float64)
    flags[0], flags[1] = take_checkpoint_request()
    flags[2] = joins
    every_rank = t.comm.meta_all_gather(torch.stack(pending + [flags]).to(t.device)).cpu()
    asked, stop_asked = (bool(every_rank[:, -1, i].any()) for i in (0, 1))
    first = t.step - len(pending) + 1
    leveled = len(t.run.levels) > 1
    records = [step_record(first + i, every_rank[:, i], leveled) for i in range(len(pending))]
    pending.clear()
    return records, asked, stop_asked, int(every_rank[:, -1, 2].max())


def check_steps(records: list[dict], bad_in_row: int, max_bad: int, lead: bool, log, scaled: bool = False) -> int:
    """Bad steps -- skipped by the strategy, or with a non-finite loss (an overlapped strategy
    skips the update that carries that loss's gradient a step later) -- are reported on stderr;
    --max-bad-steps of them in a row stop the run. Every rank sees the same gathered records,
    so all stop at the same step. `scaled` (fp16's loss scaler): a step skipped with a finite
    loss is the scaler's overflow (its scale halves, as torch's GradScaler skips), said but
    neither counted nor ending a row. Returns the new count of consecutive bad steps."""
    for i, r in enumerate(records):
        if not (r.get("skipped_ranks") or not math.isfinite(r["loss"])):
            bad_in_row = 0
            continue
        if scaled and math.isfinite(r["loss"]):
            if lead:
                print(f"warning: step {r['step']} skipped on rank(s) {', '.join(map(str, r['skipped_ranks']))}: "
                      f"a gradient overflowed in fp16 (the loss scale halves)", file=sys.stderr, flush=True)
            continue
        bad_in_row += 1
        if lead:
            what = (f"skipped (non-finite loss or gradient on rank(s) {', '.join(map(str, r['skipped_ranks']))})"
                    if r.get("skipped_ranks") else f"had loss {r['loss']}")
            print(f"warning: step {r['step']} {what}", file=sys.stderr, flush=True)
        if bad_in_row >= max_bad:
            if lead:  # the log shows the steps up to the stop
                for done in records[:i + 1]:
                    log.write(done)
            raise BadSteps(f"{bad_in_row} consecutive steps had a non-finite loss or gradient (the last at "
                           f"step {r['step']}; --max-bad-steps {max_bad}); try a lower --lr")
    return bad_in_row


def use_training_timeout(cfg) -> None:
    """From here on every collective fails after --timeout s (gloo and NCCL honour the
    group's timeout per op): a peer alive but stuck ends the run instead of hanging it.
    As torchtitan does after its first step, with torch's setter for the group's timeout."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    _set_pg_timeout(timedelta(seconds=cfg.timeout))

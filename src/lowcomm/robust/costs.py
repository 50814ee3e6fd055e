"""What a defence costs a worker besides its wire (the all-gather of every worker's Δ_r is one
of the plan's collectives, priced as the others are): the memory that holds every worker's
contribution at a sync, the memory traffic of the aggregate over it, and the scoring's forwards.
`lowcomm plan` prices these (plan/planner.py); a run measures them in its step's own work.

The aggregate reads the gathered rows X [W, n] (fp32) a few times; on an accelerator as on a
CPU that is memory-bound (a handful of operations per value), so it is counted in passes over
X, each pass W·n·4 bytes read or written, as the code in aggregators.py makes them:

    mean              1   (one reduction)
    median-norm-clip  3   (the norms, the scaled copy, its mean)
    median, trimmed   7   (sort along W: read, values and int64 indices written; the kept mask,
                           the masked copy and its sum)
    centered-clip:τ   7 + 4·CENTERED_CLIP_ITERS   (its median start, then each iteration's
                           difference, norms, scaled copy and mean)

--score's cost is compute: each worker scores one contribution a sync with three forwards of
--score-batches sequences (robust/scoring.py), 2·N FLOPs per token each.
"""
from __future__ import annotations

from dataclasses import dataclass

from .aggregators import CENTERED_CLIP_ITERS, Aggregator

ROW_BYTES = 4  # a gathered Δ_r is held and aggregated in fp32 (decoded, where the wire compressed it)
PASSES = {"mean": 1.0, "median-norm-clip": 3.0, "median": 7.0, "trimmed": 7.0,
          "centered-clip": 7.0 + 4.0 * CENTERED_CLIP_ITERS}
SCORE_FORWARDS = 3  # its batch's loss at θ_global (shared), and two at θ_global − 0.2·lr·Δ_r


@dataclass(frozen=True)
class DefenceWork:
    """One worker's work for a defence at one sync (`syncs_per_step` of them a trainer step)."""
    spec: str               # "median-norm-clip + score"
    held_bytes: int         # every worker's Δ_r, held as fp32 rows [W, n] while it is aggregated
    moved_bytes: float      # the aggregate's memory traffic: passes x W x n x 4
    score_flops: float      # the scoring's forwards on this worker (0 without --score)
    syncs_per_step: float   # 1/H for an outer step every H steps; 1 for a per-step gather (DeMo)

    def seconds(self, bytes_per_s: float, flops_per_s: float) -> float:
        """Seconds per trainer step at a worker's memory bandwidth and FLOP rate."""
        return self.syncs_per_step * (self.moved_bytes / bytes_per_s + self.score_flops / flops_per_s)


def defence_work(aggregator: Aggregator, scored: bool, world: int, numel: int, score_sequences: int,
                 seq_len: int, syncs_per_step: float) -> DefenceWork | None:
    """A defence's work at one sync of `world` workers' contributions of `numel` values (None:
    a plain mean on the all-reduce, nothing beyond the wire)."""
    if not aggregator.robust and not scored:
        return None
    rows = world * numel * ROW_BYTES
    flops = SCORE_FORWARDS * score_sequences * seq_len * 2 * numel if scored else 0.0
    spec = aggregator.spec + (" + score" if scored else "")
    return DefenceWork(spec, rows, PASSES[aggregator.rule] * rows, flops, syncs_per_step)

"""The output directory contract: config.toml, steps.jsonl, summary.json.

steps.jsonl has one JSON object per optimizer step (rank 0 writes it, from
every rank's StepResult gathered each step). Field meanings:
  loss            mean over ranks of each rank's mean micro-batch loss
  tokens, micro_batches, wire_bytes    summed over ranks
  wire_bytes_per_rank                  bytes one rank sent (max over ranks)
  compute_s, comm_s, exposed_comm_s, wall_s   max over ranks (the step waits for the slowest)
  optimizer_s     optimizer.step() time on the main thread, max over ranks (0 without the
                  flight recorder)
  per_rank        each rank's compute_s, exposed_comm_s, wall_s, optimizer_s and micro_batches:
                  a rank's wall_s less its compute, exposed comm is its own per-step work
                  (optimizer step, compression, outer step), where `lowcomm plan --calibrate` reads it
  loader_s        rank 0's seconds reading the step's batches (its windows of the data, to the
                  device: Trainer.next_batch); bench/loader_cost.py sets it against wall_s
  val_loss        present on steps where validation ran
  skipped_ranks   present on steps not applied on some rank: the ranks that found a loss or
                  gradient not finite and skipped the step (all of them, for strategies that
                  reduce gradients every step)
  link_model_s    present with an emulated link (--link): the seconds the link model prices this
                  step's collectives at (no queueing or jitter), max over ranks
  flags           present on steps where the run's analysis found something, e.g.
                  "straggler rank 1 x3.0" (diagnose/stragglers.py), "slow link x2.4 (exposed
                  240 ms, link model 100 ms)" (diagnose/slowlink.py), "stalled all_reduce #412
                  rank 1 3.2 s" (the launcher's, diagnose/stalls.py), "loss spike 9.65 (x2.8
                  the median 3.46 of the last 10 steps)" (diagnose/spikes.py)
  score_rounds    present with --score on the steps whose outer step took a scored round (a
                  list: a streaming run scores one fragment's sync a round, and the final sync
                  every fragment in the last step), each round as summary.json's score_rounds
                  has it: round, scores and fits (per worker; None where no validator could
                  score it), left_out, newly_left_out and taken_back (the workers the round's
                  scores left out and took back: what the progress line says), events (copies,
                  stale and zero contributions named, workers left out or taken back, in words),
                  and the seconds of scoring work that round
                  (its forwards and the contributions' fingerprints, not the sharing of the held
                  sequences): score_s the slowest worker's, score_s_per_rank each worker's
                  (shared by the scores' own all-reduce; absent on a round a resumed run loaded)
With replica groups (--replicas R < W) each level's share of the above, L = cross or intra:
  wire_bytes_L         summed over ranks (wire_bytes_cross + wire_bytes_intra = wire_bytes)
  exposed_comm_s_L     max over ranks
  per_rank.exposed_comm_s_L   each rank's
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..comm import CommStats
from ..storage.files import disk_full, write_text_atomic
from ..contract.context import StepResult
from .levels import LEVELS

FIELDS = ("loss", "micro_batches", "tokens", "wire_bytes", "compute_s", "comm_s",
          "exposed_comm_s", "wall_s", "lr", "skipped", "link_model_s", "optimizer_s")
# Each level's bytes and exposed seconds follow FIELDS in every rank's vector, flat run or not,
# so that all ranks gather vectors of one length; only a run with replicas writes them out.
LEVEL_FIELDS = tuple(f"{f}_{level}" for level in LEVELS for f in ("wire_bytes", "exposed_comm_s"))


def result_vector(r: StepResult) -> torch.Tensor:
    per_level = [float(v) for level in LEVELS for v in _level_values(r.levels.get(level))]
    return torch.tensor([float(getattr(r, f)) for f in FIELDS] + per_level, dtype=torch.float64)


def _level_values(stats: CommStats | None) -> tuple[float, float]:
    return (0.0, 0.0) if stats is None else (stats.wire_bytes, stats.exposed_s)


def absent_vector() -> torch.Tensor:
    """A rank's row for a step it did not train (an elastic joiner that came in mid-round): no
    tokens, bytes or time, and no loss or lr (NaN: left out of the step's loss and lr)."""
    row = torch.zeros(len(FIELDS) + len(LEVEL_FIELDS), dtype=torch.float64)
    row[FIELDS.index("loss")] = row[FIELDS.index("lr")] = float("nan")
    return row


def step_record(step: int, per_rank: torch.Tensor, levels: bool = False) -> dict:
    """Merge every rank's StepResult (rows of `per_rank`, columns FIELDS then LEVEL_FIELDS);
    `levels`: the run has replica groups, so the record splits its traffic by level."""
    col = {f: per_rank[:, i] for i, f in enumerate(FIELDS + LEVEL_FIELDS)}
    present = ~col["lr"].isnan()  # rows of ranks that trained this step (an lr is never NaN otherwise)
    if not present.any():
        present = torch.ones_like(present)
    record = {
        "step": step,
        "loss": float(col["loss"][present].mean()),  # a rank's non-finite loss shows, an absent rank's not
        "tokens": int(col["tokens"].sum()),
        "micro_batches": int(col["micro_batches"].sum()),
        "wire_bytes": int(col["wire_bytes"].sum()),
        "wire_bytes_per_rank": int(col["wire_bytes"].max()),
        "compute_s": float(col["compute_s"].max()),
        "comm_s": float(col["comm_s"].max()),
        "exposed_comm_s": float(col["exposed_comm_s"].max()),
        "wall_s": float(col["wall_s"].max()),
        "optimizer_s": float(col["optimizer_s"].max()),
        "lr": float(col["lr"][present][0]),
        "per_rank": {
            "compute_s": [round(float(v), 6) for v in col["compute_s"]],
            "exposed_comm_s": [round(float(v), 6) for v in col["exposed_comm_s"]],
            "wall_s": [round(float(v), 6) for v in col["wall_s"]],
            "optimizer_s": [round(float(v), 6) for v in col["optimizer_s"]],
            "micro_batches": [int(v) for v in col["micro_batches"]],
        },
    }
    if levels:
        for level in LEVELS:
            exposed = col[f"exposed_comm_s_{level}"]
            record[f"wire_bytes_{level}"] = int(col[f"wire_bytes_{level}"].sum())
            record[f"exposed_comm_s_{level}"] = float(exposed.max())
            record["per_rank"][f"exposed_comm_s_{level}"] = [round(float(v), 6) for v in exposed]
    if col["link_model_s"].max() > 0:  # an emulated link: what it should have taken
        record["link_model_s"] = round(float(col["link_model_s"].max()), 6)
    skipped = [r for r, v in enumerate(col["skipped"]) if v]
    if skipped:
        record["skipped_ranks"] = skipped
    return record


def write_json_atomic(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


class StepLog:
    """steps.jsonl. `resume_after=S` continues a resumed run's log: the records of steps up to S
    are kept (`kept`), later ones -- written after the checkpoint the run resumes from -- dropped,
    so the log ends with no step missing or written twice."""

    def __init__(self, out_dir: Path, resume_after: int | None = None):
        self.path = out_dir / "steps.jsonl"
        self.kept: list[dict] = []
        if resume_after is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by the crash
                    continue
                if record.get("step", 0) <= resume_after:
                    self.kept.append(record)
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.kept))
        self._f = open(self.path, "a" if resume_after is not None else "w")

    def write(self, record: dict) -> None:
        end = self._f.tell()
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk: no record left cut short
            try:
                self._f.truncate(end)
            except OSError:
                pass
            raise disk_full(e, self.path) or e

    def close(self) -> None:
        self._f.close()

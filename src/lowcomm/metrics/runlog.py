"""The output directory contract: config.toml, steps.jsonl, summary.json.

steps.jsonl has one JSON object per optimizer step (rank 0 writes it, from
every rank's StepResult gathered each step). Field meanings:
  loss            mean over ranks of each rank's mean micro-batch loss
  tokens, micro_batches, wire_bytes    summed over ranks
  wire_bytes_per_rank                  bytes one rank sent (max over ranks)
  compute_s, comm_s, exposed_comm_s, wall_s   max over ranks (the step waits for the slowest)
  per_rank        each rank's compute_s, exposed_comm_s and micro_batches
  val_loss        present on steps where validation ran
  skipped_ranks   present on steps not applied on some rank: the ranks that found a loss or
                  gradient not finite and skipped the step (all of them, for strategies that
                  reduce gradients every step)
  flags           present on steps where the run's analysis found something, e.g.
                  "straggler rank 1 x3.0" (metrics/stragglers.py)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..strategies.context import StepResult

FIELDS = ("loss", "micro_batches", "tokens", "wire_bytes", "compute_s", "comm_s",
          "exposed_comm_s", "wall_s", "lr", "skipped")


def result_vector(r: StepResult) -> torch.Tensor:
    return torch.tensor([float(getattr(r, f)) for f in FIELDS], dtype=torch.float64)


def step_record(step: int, per_rank: torch.Tensor) -> dict:
    """Merge every rank's StepResult (rows of `per_rank`, columns FIELDS)."""
    col = {f: per_rank[:, i] for i, f in enumerate(FIELDS)}
    record = {
        "step": step,
        "loss": float(col["loss"].mean()),
        "tokens": int(col["tokens"].sum()),
        "micro_batches": int(col["micro_batches"].sum()),
        "wire_bytes": int(col["wire_bytes"].sum()),
        "wire_bytes_per_rank": int(col["wire_bytes"].max()),
        "compute_s": float(col["compute_s"].max()),
        "comm_s": float(col["comm_s"].max()),
        "exposed_comm_s": float(col["exposed_comm_s"].max()),
        "wall_s": float(col["wall_s"].max()),
        "lr": float(col["lr"][0]),
        "per_rank": {
            "compute_s": [round(float(v), 6) for v in col["compute_s"]],
            "exposed_comm_s": [round(float(v), 6) for v in col["exposed_comm_s"]],
            "micro_batches": [int(v) for v in col["micro_batches"]],
        },
    }
    skipped = [r for r, v in enumerate(col["skipped"]) if v]
    if skipped:
        record["skipped_ranks"] = skipped
    return record


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


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
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.kept))
            os.replace(tmp, self.path)
        self._f = open(self.path, "a" if resume_after is not None else "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

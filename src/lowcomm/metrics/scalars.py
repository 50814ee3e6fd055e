"""Each step's scalars for the dashboards users already watch, through one interface: TensorBoard
(`--tensorboard DIR`, metrics/tensorboard.py) and Weights & Biases (`--wandb PROJECT`,
metrics/wandb_log.py). Both are optional extras a plain run never imports; each is checked
when the run is prepared (`require`), so a run asked for one without it exits 2 before
anything starts, instead of failing after its first step. Rank 0 logs; the sinks get the same
scalars at the same steps.

Scalars (the step is the trainer step; every value as in steps.jsonl, runlog.py):
  train/loss, train/val_loss, train/lr
  throughput/tokens_per_s            tokens of all ranks over the step's wall time
  comm/wire_bytes                    all ranks, this step
  comm/exposed_pct                   exposed communication, % of the step's wall time
  comm/<level>/rank0_bytes_total     bytes rank 0 sent so far on each level (cross, intra, world),
                                     at each log gather's last step
  compute_s/rank<r>                  each rank's compute time in the step (a straggler stands out)
"""
from __future__ import annotations

from typing import Protocol

from ..errors import UsageError


class ScalarSink(Protocol):
    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def step_scalars(record: dict) -> dict[str, float]:
    """One step record's scalars (runlog.step_record)."""
    out = {"train/loss": record["loss"], "train/lr": record["lr"]}
    if "val_loss" in record:
        out["train/val_loss"] = record["val_loss"]
    wall = record["wall_s"]
    if wall > 0:
        out["throughput/tokens_per_s"] = record["tokens"] / wall
        out["comm/exposed_pct"] = 100.0 * record["exposed_comm_s"] / wall
    out["comm/wire_bytes"] = record["wire_bytes"]
    for rank, seconds in enumerate(record["per_rank"]["compute_s"]):
        out[f"compute_s/rank{rank}"] = seconds
    return out


class ScalarLogs:
    """The sinks a run asked for, fed together."""

    def __init__(self, sinks: list[ScalarSink]):
        self.sinks = sinks

    @classmethod
    def for_run(cls, cfg) -> "ScalarLogs | None":
        """Rank 0's sinks for `cfg` (None when it asked for none); the packages were checked at launch."""
        sinks: list[ScalarSink] = []
        if cfg.tensorboard:
            from .tensorboard import TensorBoardLog
            sinks.append(TensorBoardLog(cfg.tensorboard))
        if cfg.wandb:
            from .wandb_log import WandbLog
            sinks.append(WandbLog(cfg))
        return cls(sinks) if sinks else None

    def write(self, records: list[dict], sent: dict[str, int]) -> None:
        """The records of one log gather; `sent`: bytes rank 0 sent so far on each level."""
        for i, record in enumerate(records):
            scalars = step_scalars(record)
            if i == len(records) - 1:
                scalars.update({f"comm/{level}/rank0_bytes_total": total for level, total in sent.items()})
            for sink in self.sinks:
                sink.write(record["step"], scalars)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def require(cfg) -> None:
    """Refuse (UsageError, exit 2) a run that asked for a sink whose package is missing."""
    if cfg.tensorboard:
        from .tensorboard import require as tensorboard
        tensorboard(cfg.tensorboard)
    if cfg.wandb:
        from .wandb_log import require as wandb
        wandb(cfg.wandb)


def missing(flag: str, package: str, install: str) -> UsageError:
    return UsageError(f"{flag} needs the {package} package, which is not installed: {install}")

"""`--tensorboard DIR`: rank 0 logs each step's scalars where TensorBoard can watch them live.

Optional: it needs the `tensorboard` package (`pip install 'lowcomm[tensorboard]'`), which a plain
run never imports. `require` checks for it when the run is prepared, so a run asked for it
without it exits 2 before anything starts, instead of failing after its first step.

Scalars (the step is the trainer step; every value as in steps.jsonl, runlog.py):
  train/loss, train/val_loss, train/lr
  throughput/tokens_per_s            tokens of all ranks over the step's wall time
  comm/wire_bytes                    all ranks, this step
  comm/exposed_pct                   exposed communication, % of the step's wall time
  comm/<level>/rank0_bytes_total     bytes rank 0 sent so far on each level (cross, intra, world)
  compute_s/rank<r>                  each rank's compute time in the step (a straggler stands out)
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

INSTALL = "pip install 'lowcomm[tensorboard]' (or: pip install tensorboard)"
FLUSH_S = 10  # a live view: TensorBoard's default of 120 s is too slow to watch a short run


def require(directory: str) -> None:
    """Refuse --tensorboard (UsageError, exit 2) when the package is missing or DIR cannot be one."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UsageError(f"--tensorboard needs the tensorboard package, which is not installed: {INSTALL}") from None
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--tensorboard {directory}: exists and is not a directory")


class TensorBoardLog:
    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(log_dir=directory, flush_secs=FLUSH_S)

    def write(self, record: dict) -> None:
        """One step record (runlog.step_record)."""
        add, step = self._writer.add_scalar, record["step"]
        add("train/loss", record["loss"], step)
        add("train/lr", record["lr"], step)
        if "val_loss" in record:
            add("train/val_loss", record["val_loss"], step)
        wall = record["wall_s"]
        if wall > 0:
            add("throughput/tokens_per_s", record["tokens"] / wall, step)
            add("comm/exposed_pct", 100.0 * record["exposed_comm_s"] / wall, step)
        add("comm/wire_bytes", record["wire_bytes"], step)
        for rank, seconds in enumerate(record["per_rank"]["compute_s"]):
            add(f"compute_s/rank{rank}", seconds, step)

    def levels(self, sent: dict[str, int], step: int) -> None:
        """Bytes rank 0 sent so far on each level ({level: bytes})."""
        for level, total in sent.items():
            self._writer.add_scalar(f"comm/{level}/rank0_bytes_total", total, step)

    def close(self) -> None:
        self._writer.close()

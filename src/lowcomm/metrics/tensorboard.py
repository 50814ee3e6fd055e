"""`--tensorboard DIR`: rank 0 logs each step's scalars (metrics/scalars.py) where TensorBoard
can watch them live. Needs the `tensorboard` package (`pip install 'lowcomm[tensorboard]'`)."""
from __future__ import annotations

from pathlib import Path

from ..errors import RunError
from ..storage.files import check_writable
from .scalars import missing

INSTALL = "pip install 'lowcomm[tensorboard]' (or: pip install tensorboard)"
FLUSH_S = 10  # a live view: TensorBoard's default of 120 s is too slow to watch a short run


def require(directory: str) -> None:
    """Refuse --tensorboard (UsageError, exit 2) when the package is missing or DIR cannot be
    written: checked before the run directory is made, not found by the first step's log."""
    check_writable(Path(directory), "--tensorboard")
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise missing("--tensorboard", "tensorboard", INSTALL) from None


class TensorBoardLog:
    """A scalar sink (metrics/scalars.py) writing TensorBoard event files."""

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter
        try:
            self._writer = SummaryWriter(log_dir=directory, flush_secs=FLUSH_S)
        except OSError as e:  # writable when checked (require); no longer: name the flag, not a bare errno
            raise RunError(f"--tensorboard {directory}: cannot write there: {e.strerror or e}") from e

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()

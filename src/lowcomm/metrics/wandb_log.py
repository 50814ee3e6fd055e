"""`--wandb PROJECT`: rank 0 logs each step's scalars (metrics/scalars.py, the same as
--tensorboard's) to a Weights & Biases run in PROJECT. Needs the `wandb` package (`pip install
'lowcomm[wandb]'`); W&B's own settings apply (`wandb login`, or WANDB_MODE=offline to sync
later). The W&B run is named after the run directory, carries the resolved config, and keeps
its local files in OUT/wandb/."""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .scalars import missing

INSTALL = "pip install 'lowcomm[wandb]' (or: pip install wandb)"
BAD_CHARS = "/\\#?%:"  # characters W&B refuses in a project name


def require(project: str) -> None:
    """Refuse --wandb (UsageError, exit 2) when the package is missing or PROJECT cannot be a name."""
    bad = [c for c in BAD_CHARS if c in project]
    if bad:
        raise UsageError(f"--wandb {project}: a W&B project name cannot contain {' '.join(bad)}")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise missing("--wandb", "wandb", INSTALL) from None


class WandbLog:
    """A scalar sink (metrics/scalars.py) logging to one W&B run."""

    def __init__(self, cfg):
        import wandb

        from ..config import to_dict
        out = Path(cfg.out) if cfg.out else None
        self._run = wandb.init(project=cfg.wandb, name=out.name if out else None, config=to_dict(cfg),
                               dir=str(out) if out else None)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()

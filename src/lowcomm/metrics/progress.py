"""Rank 0's live view: a rich progress bar on a terminal, sparse lines otherwise."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressView:
    def __init__(self, total_steps: int, title: str, enabled: bool = True):
        self.total = total_steps
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.every = max(1, total_steps // 10)
        self._bar = None
        self._flags: list[str] = []
        if self.interactive:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[mb]} MB sent"), TextColumn("comm exposed {task.fields[exp]}"),
                TimeRemainingColumn(), console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(title, total=total_steps, loss="-", tps="-", mb="0", exp="-")
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, mb_sent: float, exposed_frac: float,
               val_loss: float | None = None, flags: list[str] | None = None) -> None:
        """`flags`: what the run's analysis found at this step (metrics/stragglers.py); shown when
        they change, so a straggler is seen while the run goes, once, not on every line."""
        if not self.enabled:
            return
        flags_changed = (flags or []) != self._flags
        self._flags = flags or []
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.3f}", tps=f"{tokens_per_s:,.0f}",
                             mb=f"{mb_sent:,.1f}", exp=f"{100 * exposed_frac:.0f}%")
            if val_loss is not None:
                self._bar.console.print(f"step {step}: val_loss {val_loss:.4f}")
            if flags_changed and flags:
                self._bar.console.print(f"step {step}: {', '.join(flags)}")
        elif step % self.every == 0 or step == self.total or val_loss is not None or (flags_changed and flags):
            line = (f"step {step}/{self.total}  loss {loss:.3f}  {tokens_per_s:,.0f} tok/s  "
                    f"{mb_sent:,.1f} MB sent  comm exposed {100 * exposed_frac:.0f}%")
            if val_loss is not None:
                line += f"  val_loss {val_loss:.4f}"
            if flags:
                line += f"  {', '.join(flags)}"
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

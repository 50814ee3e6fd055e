"""Rank 0's live view: a rich progress bar on a terminal, sparse lines otherwise.

A run with replica groups adds each level's bytes per step and exposed share, so the traffic
on the slow link across replicas is told apart from the fast one inside them."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .levels import LEVEL_WORDS


class ProgressView:
    def __init__(self, total_steps: int, title: str, enabled: bool = True, levels: bool = False,
                 local_models: bool = False):
        """`local_models`: a local-SGD run (diloco and its family), whose train loss is each worker's
        own model's and whose validation loss is the global model's: the line says which is which,
        as the end summary does, so a gap between the two is not read as overfitting."""
        self.total = total_steps
        self.loss_word, self.val_word = ("own-model loss", "global-model val_loss") if local_models else \
            ("loss", "val_loss")
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self.every = max(1, total_steps // 10)
        self._bar = None
        self._flags: list[str] = []
        if self.interactive:
            # A flat run's bar has no level column at all (not an empty one).
            by_level = [TextColumn("{task.fields[levels]}")] if levels else []
            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn(f"{self.loss_word} {{task.fields[loss]}}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[mb]} MB sent"), TextColumn("comm exposed {task.fields[exp]}"),
                *by_level, TimeRemainingColumn(), console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(title, total=total_steps, loss="-", tps="-", mb="0", exp="-",
                                            levels="")
            self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, mb_sent: float, exposed_frac: float,
               val_loss: float | None = None, levels: dict[str, tuple[float, float]] | None = None,
               flags: list[str] | None = None) -> None:
        """`levels`: level -> (MB per step, exposed share), for a run with replica groups.
        `flags`: what the run's analysis found at this step (diagnose/stragglers.py); shown when
        they change, so a straggler is seen while the run goes, once, not on every line."""
        if not self.enabled:
            return
        by_level = level_text(levels or {})
        flags_changed = (flags or []) != self._flags
        self._flags = flags or []
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=f"{loss:.3f}", tps=f"{tokens_per_s:,.0f}",
                             mb=f"{mb_sent:,.1f}", exp=f"{100 * exposed_frac:.0f}%",
                             levels=level_text(levels or {}, short=True))
            if val_loss is not None:
                self._bar.console.print(f"step {step}: {self.val_word} {val_loss:.4f}")
            if flags_changed and flags:
                self._bar.console.print(f"step {step}: {', '.join(flags)}")
        elif step % self.every == 0 or step == self.total or val_loss is not None or (flags_changed and flags):
            line = (f"step {step}/{self.total}  {self.loss_word} {loss:.3f}  {tokens_per_s:,.0f} tok/s  "
                    f"{mb_sent:,.1f} MB sent  comm exposed {100 * exposed_frac:.0f}%")
            if by_level:
                line += f"  {by_level}"
            if val_loss is not None:
                line += f"  {self.val_word} {val_loss:.4f}"
            if flags:
                line += f"  {', '.join(flags)}"
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def level_text(levels: dict[str, tuple[float, float]], short: bool = False) -> str:
    """'across replicas 0.085 MB/step exposed 42% | inside replicas 0.170 MB/step exposed 9%';
    `short` (the bar, which shares a terminal's width with nine other columns):
    'cross 0.085 MB/step 42% | intra 0.170 MB/step 9%', in the config's names of the levels."""
    return " | ".join(
        (f"{level} {_mb(mb)} MB/step {100 * exposed:.0f}%" if short
         else f"{LEVEL_WORDS[level]} {_mb(mb)} MB/step exposed {100 * exposed:.0f}%")
        for level in LEVEL_WORDS if level in levels for mb, exposed in [levels[level]])


def _mb(mb: float) -> str:
    """Three significant figures or so: tiny test models send kilobytes a step, big ones gigabytes."""
    return f"{mb:,.0f}" if mb >= 100 else f"{mb:.1f}" if mb >= 1 else f"{mb:.3f}"

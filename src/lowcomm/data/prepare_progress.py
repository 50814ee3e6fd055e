"""`lowcomm data prepare`'s progress bar on stderr: tokens written, tokens/s, and the time left
told from the source's bytes read (the one total known before reading)."""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn


class PrepareBar:
    """A bar per pass (training a BPE reads the source once more); nothing when disabled or not a terminal."""

    def __init__(self, total_bytes: int, enabled: bool = True, console: Console | None = None):
        self.total, self.tokens, self.started = max(total_bytes, 1), 0, time.perf_counter()
        self._bar = None
        if enabled and (console is not None or sys.stderr.isatty()):
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                 TextColumn("{task.fields[tokens]}"), TimeRemainingColumn(),
                                 console=console or Console(stderr=True), transient=False)
            self._bar.start()
        self._task = None

    def start(self, description: str) -> None:
        self.started, self.tokens = time.perf_counter(), 0
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=self.total, tokens="")

    def advance(self, done_bytes: int, tokens: int = 0) -> None:
        self.tokens += tokens
        if self._bar is not None and self._task is not None:
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            words = f"{self.tokens:,} tokens  {rate:,.0f} tokens/s" if self.tokens else ""
            self._bar.update(self._task, completed=min(done_bytes, self.total), tokens=words)

    def describe(self, description: str) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=description)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

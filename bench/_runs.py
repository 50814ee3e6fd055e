"""The one way the benchmark scripts run `lowcomm train`: a subprocess, as a user runs it.

    from _runs import train                  # bench/ is on sys.path when a script runs
    run = train(out_dir, "--strategy", "zero1", "--steps", "50")
    run.summary, run.steps, run.wall_s       # summary.json, steps.jsonl records, process wall time

A failed run ends the benchmark with its command and the tail of its stderr, unless the caller
expects some to fail (`check=False`: an attack that makes the loss diverge): then its summary is
`{"failed": the last line of its stderr}`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchRun:
    """What one `lowcomm train` subprocess left: its summary.json, its steps.jsonl records,
    and the process's wall time."""

    summary: dict
    steps: list[dict]
    wall_s: float


def train(out: Path, *flags: str, env: dict | None = None, echo: bool = False, check: bool = True) -> BenchRun:
    cmd = [sys.executable, "-m", "lowcomm", "train", "--quiet", "--out", str(out), *flags]
    if echo:
        print("  $ lowcomm", " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    if proc.returncode != 0 and not check:
        return BenchRun({"failed": (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]}, [], wall)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    return BenchRun(summary, steps, wall)

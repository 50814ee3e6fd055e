"""Reading what `lowcomm train` and `lowcomm bench` wrote: runs, benches, validation curves.

A run dir holds summary.json and steps.jsonl (metrics/runlog.py); a bench dir holds
bench.json, which lists its runs (by sub-directory) and the ones that failed. A run that did not
finish (no summary.json) is read from its steps.jsonl and config.toml (metrics/unfinished.py).
Time along a run is the summed wall time of its steps (each step's slowest rank):
evaluation and log gathering are left out, so strategies are compared on training time.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import UsageError
from ..engines.outer_options import outer_step_suffix
from .unfinished import summary_from_log

BENCH_FILE = "bench.json"


@dataclass
class Point:
    """A validation point: the run's time, tokens and bytes (all ranks) when it was taken."""
    step: int
    time_s: float
    tokens: int
    wire_bytes: int
    val_loss: float


@dataclass
class RecordedRun:
    """A run as read back from its directory (summary.json, steps.jsonl, config.toml); one that did
    not finish has a summary made from the other two, with `finished` False (metrics/unfinished.py)."""
    label: str
    path: Path
    summary: dict
    steps: list[dict]
    config: dict
    group: str = ""            # the strategy a run of `lowcomm bench --repeats` repeats (else its label)
    round: int | None = None   # which of those interleaved rounds it ran in

    @property
    def curve(self) -> list[Point]:
        points, t, tokens, wire = [], 0.0, 0, 0
        for rec in self.steps:
            t += rec["wall_s"]
            tokens += rec["tokens"]
            wire += rec["wire_bytes"]
            if "val_loss" in rec:
                points.append(Point(rec["step"], t, tokens, wire, rec["val_loss"]))
        return points

    def tokens_per_micro_batch(self) -> float:
        """Tokens in one micro-batch as the run computed it: its tokens over its micro-batches
        (acco's loader cuts each --micro-batch in two), else --micro-batch x --seq-len."""
        s = self.summary
        if s.get("tokens") and sum(s.get("micro_batches_per_rank", ())):
            return s["tokens"] / sum(s["micro_batches_per_rank"])
        return self.config.get("micro_batch", 16) * self.config.get("model", {}).get("seq_len", 128)


@dataclass
class Failed:
    label: str
    error: str
    path: Path | None = None


@dataclass
class Bench:
    path: Path
    meta: dict
    entries: list = field(default_factory=list)  # RecordedRun or Failed, in bench order


def is_run(path: Path) -> bool:
    return (path / "summary.json").is_file() and (path / "steps.jsonl").is_file()


def is_unfinished_run(path: Path) -> bool:
    """A run stopped, killed or crashed before it wrote summary.json: its config.toml and steps.jsonl."""
    return not (path / "summary.json").exists() and (path / "steps.jsonl").is_file() and \
        (path / "config.toml").is_file()


def load_run(path: str | Path, label: str | None = None) -> RecordedRun:
    p = Path(path)
    if not is_run(p):
        raise UsageError(f"'{path}' is not a lowcomm run (no summary.json and steps.jsonl in it)")
    try:
        summary = json.loads((p / "summary.json").read_text())
        steps, config = _read_log(p)
    except (ValueError, OSError) as e:
        raise UsageError(f"'{path}' is not a readable lowcomm run: {e}") from None
    if not isinstance(summary, dict) or "strategy" not in summary or "final_val_loss" not in summary:
        raise UsageError(f"'{path}' is not a lowcomm run (its summary.json has no strategy or final_val_loss)")
    return RecordedRun(label or summary["strategy"] + outer_step_variant(summary), p, summary, steps, config)


def load_unfinished(path: str | Path) -> RecordedRun:
    """A run that did not finish (is_unfinished_run), read as far as its steps.jsonl goes: a line
    cut short where the run was killed mid-write is left out."""
    p = Path(path)
    try:
        steps, config = _read_log(p, cut_short_ok=True)
    except (ValueError, OSError) as e:
        raise UsageError(f"'{path}' is not a readable lowcomm run: {e}") from None
    if not isinstance(config.get("strategy"), str):
        raise UsageError(f"'{path}' is not a lowcomm run (its config.toml names no strategy)")
    if not steps:
        raise UsageError(f"'{path}' did not finish and logged no step (no summary.json, steps.jsonl empty): "
                         f"nothing to report")
    summary = summary_from_log(steps, config)
    return RecordedRun(summary["strategy"] + outer_step_variant(summary), p, summary, steps, config)


def _read_log(p: Path, cut_short_ok: bool = False) -> tuple[list[dict], dict]:
    """steps.jsonl's records and config.toml ({} where absent); `cut_short_ok`: skip a last line
    that is not whole JSON (the run died writing it)."""
    lines = [line for line in (p / "steps.jsonl").read_text().splitlines() if line.strip()]
    if cut_short_ok and lines:
        try:
            json.loads(lines[-1])
        except ValueError:
            lines.pop()
    steps = [json.loads(line) for line in lines]
    config = tomllib.loads((p / "config.toml").read_text()) if (p / "config.toml").is_file() else {}
    return steps, config


def outer_step_variant(summary: dict) -> str:
    """' delayed' or ' eager' for a local-SGD run whose outer step was one period late (so a
    report of a synchronous and a delayed run tells them apart by more than their directories)."""
    options = summary.get("strategy_options") or {}
    return outer_step_suffix(options.get("outer_delay", 0), bool(options.get("eager")))


def is_bench(path: Path) -> bool:
    return (path / BENCH_FILE).is_file()


def load_bench(path: str | Path) -> Bench:
    p = Path(path)
    if not is_bench(p):
        raise UsageError(f"'{path}' is not a lowcomm bench (no {BENCH_FILE} in it)")
    try:
        meta = json.loads((p / BENCH_FILE).read_text())
        listed = meta["runs"]
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise UsageError(f"'{path}' has an unreadable {BENCH_FILE}: {e}") from None
    bench = Bench(p, meta)
    for r in listed:
        if r.get("status") == "ok":
            run = load_run(p / r["dir"], r["label"])
            run.group, run.round = r.get("group", ""), r.get("round")
            bench.entries.append(run)
        else:
            bench.entries.append(Failed(r["label"], r.get("error") or "failed", p / r["dir"]))
    return bench


def load_calibration(path: str | Path) -> Bench:
    """A bench, or one run (`lowcomm train --out`) read as a bench of that run: what
    `lowcomm plan --calibrate` measures compute, overhead and loss per token from."""
    p = Path(path)
    if is_run(p) and not is_bench(p):
        run = load_run(p)  # a run dir records its machine at its end (summary.json)
        return Bench(p, {"machine": run.summary["machine"]} if "machine" in run.summary else {}, [run])
    if not is_bench(p):
        raise UsageError(f"'{path}' is not a lowcomm bench or run (no {BENCH_FILE}, nor summary.json and steps.jsonl)")
    return load_bench(p)


def load_entries(paths: list[str]) -> list:
    """Runs and failures from run dirs and bench dirs, in the order given; a run dir may be of a run
    that did not finish."""
    entries = []
    for path in paths:
        p = Path(path)
        if is_bench(p):
            entries.extend(load_bench(p).entries)
        elif is_run(p):
            entries.append(load_run(p))
        elif is_unfinished_run(p):
            entries.append(load_unfinished(p))
        else:
            raise UsageError(f"'{path}' is not a lowcomm run or bench (no summary.json, steps.jsonl or {BENCH_FILE})")
    labels = [e.label for e in entries]
    for i, e in enumerate(entries):  # two runs of one strategy: tell them apart by their directory
        if labels.count(e.label) > 1 and e.path is not None:
            e.label = f"{e.label} ({e.path.name})"
    return entries


def reach(curve: list[Point], target: float, key: str) -> float | None:
    """The value of `key` (time_s, tokens, wire_bytes) when the validation loss first
    reaches `target`, linearly interpolated between the two validation points around it."""
    prev = None
    for p in curve:
        if p.val_loss <= target:
            if prev is None or prev.val_loss == p.val_loss:
                return float(getattr(p, key))
            a = (prev.val_loss - target) / (prev.val_loss - p.val_loss)
            return getattr(prev, key) + a * (getattr(p, key) - getattr(prev, key))
        prev = p
    return None

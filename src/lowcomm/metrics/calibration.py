"""What `lowcomm plan --calibrate` takes from a bench: the model's compute, each strategy's own
per-step work, and a caveat wherever those figures cannot be trusted.

Compute is the model's, not the strategy's: one micro-batch's forward and backward is the same
arithmetic whichever strategy runs around it. Each run gives its figure the same way -- each
step's slowest rank's compute per token (its emulated slowdown divided out: a synchronous step
waits for that rank), averaged over the run's steps -- and the calibration prices every strategy
at the median of its runs' figures (ratio_median). A run more than COMPUTE_SPREAD from that median measured
something besides the model: on a CPU host whose workers share cores, workers that never wait
for each other (DiLoCo between syncs) compete for the cores all the time, workers that wait in a
collective each step (ddp) leave them free. Such a run is named in a caveat, not used.

Per-step work is the strategy's: on each rank, the step's wall time less its compute and its
network waits -- the optimizer step (the flight recorder's optimizer spans, steps.jsonl's
per_rank.optimizer_s), compression, the outer step -- averaged over ranks and steps.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field

# A run's compute per token this many times the bench's median (or below it) is not the model's.
# Runs of one bench on a quiet machine agree within a few percent (bench/validate_plan.py).
COMPUTE_SPREAD = 1.25


@dataclass
class Work:
    """A strategy's per-step work outside forward/backward and network waits, seconds per step."""
    optimizer_s: float  # optimizer.step() on the main thread
    other_s: float      # the rest: compression, outer step bookkeeping, loading the batch

    @property
    def total_s(self) -> float:
        return self.optimizer_s + self.other_s


@dataclass
class Calibration:
    per_token_s: float          # the model's forward+backward per token, one 1x worker (the median run)
    params: int                 # the bench's model size (per_token_s scales with it)
    tokens_per_micro: int       # the bench's micro-batch, in tokens
    per_run: dict = field(default_factory=dict)   # each run's own per-token figure, by label
    work: dict = field(default_factory=dict)      # Work by strategy
    caveats: list = field(default_factory=list)   # one line each

    @property
    def per_micro_s(self) -> float:
        return self.per_token_s * self.tokens_per_micro

    def seconds_per_token(self, params: int) -> float:
        """Per token for a model of `params` parameters (compute grows about linearly with N)."""
        return self.per_token_s * params / self.params


def calibrate(bench, runs: dict) -> Calibration:
    """The calibration of `bench` (metrics/runs.Bench); `runs`: its run of each strategy."""
    recorded = [e for e in bench.entries if hasattr(e, "summary")]
    first = recorded[0]
    # each run's figure at the first run's model size (a recipe may vary it; compute grows ~linearly with N)
    per_run = {e.label: run_seconds_per_token(e) * first.summary["params"] / e.summary["params"] for e in recorded}
    median = ratio_median(per_run.values())
    apart = {label: s for label, s in per_run.items() if max(s / median, median / s) > COMPUTE_SPREAD}
    kept = [s for label, s in per_run.items() if label not in apart]
    calibration = Calibration(ratio_median(kept or per_run.values()), first.summary["params"],
                              tokens_per_micro(first), per_run, {name: run_work(run) for name, run in runs.items()})
    contended = contention(bench.meta, max(e.summary["workers"] for e in recorded))
    if contended:
        calibration.caveats.append(contended)
    if apart:
        micro = calibration.tokens_per_micro
        calibration.caveats.append(
            f"compute per micro-batch differs between the bench's runs by more than {COMPUTE_SPREAD:g}x: "
            + ", ".join(f"{label} {_ms(micro * s)}" for label, s in apart.items())
            + f" against the median {_ms(micro * median)}: not the model's arithmetic (CPU contention?); "
              f"every strategy is priced at {_ms(calibration.per_micro_s)}, the median of "
              + ("the others" if kept else "them all"))
    return calibration


def ratio_median(values) -> float:
    """The median; of an even count the geometric mean of the middle two, so that a run k times
    above it and one k times below it are alike (of two runs 1.5x apart: both, or neither, off)."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else math.sqrt(v[mid - 1] * v[mid])


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:,.0f} ms" if seconds >= 0.1 else f"{1000 * seconds:.3g} ms"


def tokens_per_micro(run) -> int:
    """The run's --micro-batch in tokens (what the plan's figure is quoted per)."""
    return run.config.get("micro_batch", 16) * run.config.get("model", {}).get("seq_len", 128)


def run_seconds_per_token(run) -> float:
    """One 1x worker's forward+backward per token in `run`, as a step waits for it: each step's
    slowest rank (its emulated slowdown divided out), averaged over steps. A log without every
    rank's times (an older run) gives each rank's total over its tokens, averaged over ranks."""
    s, per_micro = run.summary, run.tokens_per_micro_batch()  # as computed: acco halves each micro-batch
    factors = s.get("slowdown") or [1.0] * s["workers"]
    per_step = [max(c / f / (m * per_micro) for c, f, m in zip(r["per_rank"]["compute_s"], factors,
                                                               r["per_rank"]["micro_batches"]) if m)
                for r in run.steps if "per_rank" in r and any(r["per_rank"]["micro_batches"])]
    if per_step and len(per_step) == len(run.steps):
        return sum(per_step) / len(per_step)
    per_rank = [c / f / (m * per_micro) for c, f, m in zip(s["compute_s_per_rank"], factors,
                                                           s["micro_batches_per_rank"]) if m]
    return sum(per_rank) / len(per_rank)


def run_work(run) -> Work:
    """`run`'s per-step work: each rank's wall time less its compute and network waits, with its
    optimizer step split out, averaged over the ranks and steps. A log without each rank's wall
    time (an older run) gives the residual of the rank that computed longest (the one the step
    waited for; a faster rank's wait holds the slow one's compute), with no optimizer split."""
    steps = [_step_work(r) for r in run.steps]
    steps = [w for w in steps if w is not None]
    if not steps:
        return Work(0.0, 0.0)
    total = max(0.0, statistics.fmean(t for t, _ in steps))
    optimizer = min(total, statistics.fmean(o for _, o in steps))
    return Work(optimizer, total - optimizer)


def _step_work(record: dict) -> tuple[float, float] | None:
    """(per-step work, of it the optimizer step) of one step record, or None for a step with no ranks."""
    ranks = record.get("per_rank")
    if not ranks:
        return record["wall_s"] - record["compute_s"] - record["exposed_comm_s"], 0.0
    if "wall_s" not in ranks:
        slowest = max(range(len(ranks["compute_s"])), key=lambda i: ranks["compute_s"][i])
        return record["wall_s"] - ranks["compute_s"][slowest] - ranks["exposed_comm_s"][slowest], 0.0
    optimizer = ranks.get("optimizer_s") or [0.0] * len(ranks["wall_s"])
    rows = [(w - c - e, o) for w, c, e, o in zip(ranks["wall_s"], ranks["compute_s"], ranks["exposed_comm_s"],
                                                optimizer) if w > 0]  # an absent rank (elastic) took no time
    if not rows:
        return None
    return statistics.fmean(t for t, _ in rows), statistics.fmean(o for _, o in rows)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return 0.0


def machine_at_end(threads: int) -> dict:
    """summary.json's "machine": what a calibration from this run dir needs to say whether its
    workers shared cores (`threads`: this host's worker threads computing on the CPU, 0 on GPUs)."""
    return {"cores": cpu_cores(), "threads": threads, "load_at_end": load()}


def contention(meta: dict, workers: int) -> str | None:
    """The caveat for a bench whose workers shared cores (or that did not record whether they did):
    more worker threads than cores, or a 1-minute load above the cores at its start or at the end
    of a run (bench/machine.py records both). `workers`: the most any of its runs had."""
    machine = meta.get("machine")
    if not machine:
        return ("the calibration recorded no core count or load (a bench or run of an older lowcomm): "
                "whether its workers shared cores, and so measured CPU contention as compute, is unknown")
    loads = [machine.get("load_at_start", 0.0), machine.get("load_at_end", 0.0)] + \
        [r["load"] for r in meta.get("runs", []) if "load" in r]
    busy = shared_cores(machine.get("threads", workers), machine["cores"], max(loads))
    return (f"the calibration ran {busy}: its compute includes waiting for a core, so the step times below "
            f"are not claimed accurate; calibrate with at most {machine['cores']} worker threads on a quiet machine"
            if busy else None)


def shared_cores(threads: int, cores: int, load: float) -> str | None:
    """Why a bench's workers share cores, in words with the figures (None when they need not).
    `threads`: its worker threads computing on the CPU (0: on GPUs)."""
    if threads > cores:
        return f"{threads} worker threads on {cores} cores (load up to {load:g})"
    if load > cores:
        return f"at a load up to {load:g}, above its {cores} cores"
    return None

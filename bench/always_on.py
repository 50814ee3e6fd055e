#!/usr/bin/env python
"""What the always-on flight recorder (comm/flight.py) costs, measured three ways.

    python bench/always_on.py                                   # default model (tiny), ddp, W=2
    python bench/always_on.py --model small --micro-batch 4 --steps 40 --pairs 3 --within 2

1. Inside one run (the robust figure): LOWCOMM_FLIGHT=alternate records on steps 1, 4, 5, 8, ...
   and not on 2, 3, 6, 7, ... (diagnose/flight_cost.py), so both arms see the same load on the
   machine. Adjacent steps (1,2), (3,4), ... make pairs, one step of each arm; printed: the
   median over all pairs of on/off step wall time (steps.jsonl's wall_s, the slowest rank's),
   with the middle half of the pairs' ratios and each run's median.
2. The recorder's own time: in those runs it times its calls (open, close) on the steps it
   records, less the timer's own cost: its seconds per recorded step over the median step.
3. Whole runs, as a user sees them: pairs of runs, one with LOWCOMM_FLIGHT=off, in alternating
   order; each run's median step after the first --skip. Noisy on a shared machine (other jobs
   come and go between runs): the spread of the pairs says how much.
Then the bytes: the ring in shared memory per rank, what a failure writes (flight/rank-N.json
of a full ring), and what always-on adds to steps.jsonl per 1,000 steps (its `flags`).
LOWCOMM_FLIGHT is the benchmark's switch only; users have no way to turn the recorder off.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections import Counter
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import train  # noqa: E402

from lowcomm.comm.flight import CAPACITY, ENV_OFF, HEADER, SLOT  # noqa: E402
from lowcomm.diagnose.flight_cost import ALTERNATE, recording_on  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--within", type=int, default=3, help="runs recording on alternate steps (default: 3)")
    p.add_argument("--pairs", type=int, default=3, help="on/off pairs of whole runs (default: 3)")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default: 200)")
    p.add_argument("--skip", type=int, default=4, help="first steps left out (default: 4)")
    p.add_argument("--model", default="tiny", help="model preset (default: tiny, the default model)")
    p.add_argument("--micro-batch", default="16", help="sequences per micro-batch (default: 16, the default)")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--workers", default="2")
    args = p.parse_args()
    flags = ["--strategy", args.strategy, "--workers", args.workers, "--model", args.model,
             "--micro-batch", args.micro_batch, "--steps", str(args.steps), "--eval-every", "0", "--log-every", "1"]
    print(f"{args.model}, {args.strategy}, W={args.workers}, {args.steps} steps a run; load {_load()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [train(Path(tmp) / f"alt-{i}", *flags, env={ENV_OFF: ALTERNATE}) for i in range(args.within)]
        costs = [[json.loads(f.read_text()) for f in sorted((Path(tmp) / f"alt-{i}").glob("flight-cost-rank-*.json"))]
                 for i in range(args.within)]
        within(runs, args.skip)
        own_time(runs, costs, args.skip)
        whole = whole_runs(Path(tmp), flags, args.pairs, args.skip)
        sizes(runs + whole, costs)
    print(f"load {_load()}")
    return 0


def within(runs, skip: int) -> None:
    ratios, per_run = [], []
    for run in runs:
        walls = {r["step"]: r["wall_s"] for r in run.steps}
        mine = [(walls[s] / walls[s + 1]) if recording_on(s) else (walls[s + 1] / walls[s])
                for s in range(skip + 1, max(walls), 2) if s + 1 in walls]
        ratios += mine
        per_run.append(statistics.median(mine))
    low, high = _bootstrap_median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"1. inside one run, on/off step time: {statistics.median(ratios):.4f} (median of {len(ratios)} pairs of "
          f"adjacent steps, 90% bootstrap interval {low:.4f}-{high:.4f}; the pairs' middle half {q1:.3f}-{q3:.3f}; "
          f"each run's median {', '.join(f'{r:.4f}' for r in per_run)}); the least-disturbed steps (each arm's "
          f"10th percentile): {_fastest(runs, skip, True) / _fastest(runs, skip, False):.4f}", flush=True)


def _fastest(runs, skip: int, on: bool) -> float:
    """An arm's 10th-percentile step: other jobs only ever add time, so the fast steps show the cost bare."""
    walls = [r["wall_s"] for run in runs for r in run.steps[skip:] if recording_on(r["step"]) == on]
    return statistics.quantiles(walls, n=10)[0]


def _bootstrap_median(values: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.05 * draws)], medians[int(0.95 * draws) - 1]


def own_time(runs, costs, skip: int) -> None:
    typical, total = [], []
    steps = []
    for run, ranks in zip(runs, costs):
        off = statistics.median(r["wall_s"] for r in run.steps[skip:] if not recording_on(r["step"]))
        steps.append(off)
        for c in ranks:
            calls = c["calls"] / c["steps_recorded"]
            typical.append(calls * c["median_s"] / off)
            total.append(c["seconds"] / c["steps_recorded"] / off)
    calls = statistics.median(c["calls"] / c["steps_recorded"] for ranks in costs for c in ranks)
    per_call = statistics.median(c["median_s"] for ranks in costs for c in ranks)
    print(f"2. the recorder's own time: {calls:.0f} calls a step at a median {per_call * 1e9:.0f} ns: "
          f"{100 * statistics.median(typical):.3f}% of the median step ({statistics.median(steps) * 1e3:.1f} ms); "
          f"all its calls' time, descheduled ones whole: {100 * statistics.median(total):.3f}% "
          f"(per rank and run {100 * min(total):.3f}-{100 * max(total):.3f}%)", flush=True)


def whole_runs(tmp: Path, flags: list, pairs: int, skip: int) -> list:
    ratios, done = [], []
    for i in range(pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        step_s = {}
        for mode in order:
            run = train(tmp / f"{i}-{mode}", *flags, env={ENV_OFF: mode})
            step_s[mode] = statistics.median(r["wall_s"] for r in run.steps[skip:])
            done.append(run)
        ratios.append(step_s["on"] / step_s["off"])
    if ratios:
        print(f"3. whole runs, on/off median step: {statistics.median(ratios):.4f} (median of {pairs} pairs; range "
              f"{min(ratios):.4f}-{max(ratios):.4f})", flush=True)
    return done


def sizes(runs, costs) -> None:
    ring = HEADER.size + CAPACITY * SLOT.size
    per_event = statistics.median(c["dump_bytes"] / c["events_held"] for ranks in costs for c in ranks)
    records = [r for run in runs for r in run.steps]
    log = sum(len(json.dumps(r)) + 1 for r in records)
    flagged = sum(len(json.dumps(r)) - len(json.dumps({k: v for k, v in r.items() if k != "flags"}))
                  for r in records)
    print(f"kept: a fixed ring of {ring / 1024:.0f} KiB per rank in shared memory ({CAPACITY} events); on disk "
          f"per 1,000 steps {1000 * flagged / len(records):,.0f} bytes of flags in steps.jsonl "
          f"({sum(1 for r in records if 'flags' in r)} of {len(records)} steps flagged: {_kinds(records)}; "
          f"steps.jsonl itself "
          f"{1000 * log / len(records) / 1e6:.2f} MB per 1,000 steps, written with or without the recorder), "
          f"nothing else unless the run fails: then flight/rank-N.json, at most "
          f"{per_event * CAPACITY / 1e6:.2f} MB per rank (a full ring at {per_event:.0f} bytes per event) whatever "
          f"the run's length")


def _kinds(records: list[dict]) -> str:
    """How many flags of each kind ('straggler', 'slow link', 'stalled')."""
    kinds = Counter(" ".join(f.split()[:2]) if f.startswith("slow") else f.split()[0]
                    for r in records for f in r.get("flags", []))
    return ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()) or "none"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())

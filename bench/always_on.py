#!/usr/bin/env python
"""What the always-on flight recorder (metrics/flight.py) costs: the same run with it and without.

    python bench/always_on.py                      # default model (tiny), ddp, W=2, 3 pairs of 60 steps
    python bench/always_on.py --model small --micro-batch 4 --pairs 3 --steps 20

Each pair is two `lowcomm train` runs, identical but for LOWCOMM_FLIGHT=off in one (the
benchmark's switch; users have no way to turn the recorder off), in alternating order (on/off,
off/on, ...) so a load change on the machine falls on both alike. A run's step time is the
median over its steps after the first `--skip` of steps.jsonl's wall_s (the slowest rank's).
Wall time on a shared machine is noisy (other jobs preempt the ranks): read the median of the
pairs and their spread together. Printed: each pair's ratio on/off, their median (target <= 1.02),
and the bytes the recording
keeps: its fixed ring in shared memory per rank, nothing on disk unless a run fails; for scale,
steps.jsonl's bytes per 1,000 steps.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _runs import train  # noqa: E402

from lowcomm.metrics.flight import CAPACITY, ENV_OFF, HEADER, SLOT  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="on/off pairs (default: 3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default: 60)")
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the median (default: 5)")
    p.add_argument("--model", default="tiny", help="model preset (default: tiny, the default model)")
    p.add_argument("--micro-batch", default="16", help="sequences per micro-batch (default: 16, the default)")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--workers", default="2")
    args = p.parse_args()

    flags = ["--strategy", args.strategy, "--workers", args.workers, "--model", args.model,
             "--micro-batch", args.micro_batch, "--steps", str(args.steps), "--eval-every", "0",
             "--log-every", "1"]
    ratios, medians = [], {"on": [], "off": []}
    jsonl_bytes_per_step = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            step_s = {}
            for mode in order:
                out = Path(tmp) / f"{i}-{mode}"
                run = train(out, *flags, env={ENV_OFF: mode})
                walls = [r["wall_s"] for r in run.steps[args.skip:]]
                step_s[mode] = statistics.median(walls)
                medians[mode].append(step_s[mode])
                jsonl_bytes_per_step.append((out / "steps.jsonl").stat().st_size / len(run.steps))
            ratios.append(step_s["on"] / step_s["off"])
            print(f"pair {i + 1} ({'/'.join(order)}): median step on {step_s['on'] * 1e3:.1f} ms, "
                  f"off {step_s['off'] * 1e3:.1f} ms, on/off {ratios[-1]:.4f}", flush=True)
    ring = HEADER.size + CAPACITY * SLOT.size
    print(f"{args.model}, {args.strategy}, W={args.workers}, {args.pairs} pairs of {args.steps} steps: "
          f"always-on recording costs on/off = {statistics.median(ratios):.4f} (median of pairs; "
          f"range {min(ratios):.4f}-{max(ratios):.4f}); median step {statistics.median(medians['on']) * 1e3:.1f} ms "
          f"on, {statistics.median(medians['off']) * 1e3:.1f} ms off")
    print(f"kept: a fixed ring of {ring / 1024:.0f} KiB per rank in shared memory ({CAPACITY} events), "
          f"0 bytes on disk per 1,000 steps unless the run fails (then flight/rank-N.json); "
          f"steps.jsonl for comparison: {statistics.median(jsonl_bytes_per_step) * 1000 / 1e6:.2f} MB "
          f"per 1,000 steps at --log-every 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())

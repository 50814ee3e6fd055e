"""ACCO vs ZeRO-1 on an emulated link where ACCO's rounds just hide behind its compute.

    python bench/acco.py                  # W=2
    python bench/acco.py --workers 4      # W=4 (oversubscribes a 2-core machine: says so)

An ACCO step is one update of ZeRO-1's batch, in two rounds (estimate, real) that each
compute half of it and each send ZeRO-1's step bytes. So ACCO hides its communication
when one round's communication lasts no longer than half a step's compute, and at that
point ZeRO-1 waits half a step more: 1/1.5 = 0.667 is the limit of ACCO / ZeRO-1 wall
time per token with exactly --accum micro-batches per round (adaptive rounds compute more
while they wait, so they can go below it).

1. Calibrate: a short ZeRO-1 run without a link measures compute seconds per
   step; the link's bandwidth is then set so that one step's modeled
   communication (reduce-scatter + all-gather, ring formulas of comm/wire.py)
   takes half that long: one ACCO round's communication ≈ its compute.
2. Same flags, same tokens, on that link: zero1, acco (deterministic: exactly
   --accum half micro-batches per round, so tokens and updates are zero1's), and acco
   in its default adaptive mode (it keeps accumulating while a round is in flight).
3. Uneven workers (--slowdown 1,2): zero1 against acco in its adaptive mode,
   where the fast worker keeps accumulating while the round waits.

Printed: wall time per token ACCO / ZeRO-1 (0.667 is the deterministic limit),
ACCO's exposed-communication fraction (target <= 10%), validation loss at equal
tokens and updates, and the uneven-worker throughput ratio. Times are per-step wall
times from steps.jsonl (max over ranks), skipping the first steps; runs are side by
side in one invocation.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from lowcomm.comm.wire import latency_hops, wire_bytes

from _runs import train

SKIP = 4  # first steps: start-up, allocator warm-up


def run(out: Path, args, *flags) -> tuple[dict, list[dict]]:
    r = train(out, "--workers", str(args.workers), "--model", args.model, "--micro-batch", str(args.micro_batch),
              "--seq-len", str(args.seq_len), "--eval-every", "0", *flags)
    return r.summary, r.steps


def per_token(steps: list[dict]) -> float:
    kept = steps[SKIP:]
    return sum(s["wall_s"] for s in kept) / sum(s["tokens"] for s in kept)


def exposed_fraction(steps: list[dict]) -> float:
    kept = steps[SKIP:]
    return sum(s["exposed_comm_s"] for s in kept) / sum(s["wall_s"] for s in kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--latency", default="1ms")
    ap.add_argument("--keep", help="keep the runs in this directory")
    args = ap.parse_args()
    if args.workers > (os.cpu_count() or 1):
        print(f"note: {args.workers} workers on {os.cpu_count()} cores oversubscribe the CPU; "
              "compute times include waiting for a core")

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lowcomm-bench-acco-"))
    root.mkdir(parents=True, exist_ok=True)
    a, steps = str(args.accum), str(args.steps)

    calib, calib_steps = run(root / "calibrate", args, "--strategy", "zero1", "--accum", a, "--steps", "12")
    compute = statistics.median(s["compute_s"] for s in calib_steps[SKIP:])
    padded = -(-calib["params"] // args.workers) * args.workers * 4
    step_bytes = wire_bytes("reduce_scatter", padded, args.workers) + wire_bytes("all_gather", padded, args.workers)
    latency = float(args.latency.rstrip("ms")) / 1e3 if args.latency.endswith("ms") else float(args.latency)
    hops = latency_hops("reduce_scatter", args.workers) + latency_hops("all_gather", args.workers)
    round_s = compute / 2  # an ACCO round computes half the step's batch
    bandwidth = step_bytes / max(round_s - hops * latency, round_s / 2)
    link = f"{bandwidth * 8 / 1e6:.1f}mbit,{args.latency}"
    print(f"calibration: zero1 computes {compute * 1e3:.0f} ms per step and sends {step_bytes / 1e6:.2f} MB "
          f"per rank -> link {link} (modeled communication ≈ half a step's compute: one ACCO round's)")

    z1, z1_steps = run(root / "zero1", args, "--strategy", "zero1", "--accum", a, "--steps", steps, "--link", link)
    ac, ac_steps = run(root / "acco", args, "--strategy", "acco", "--accum", a, "--steps", steps,
                       "--deterministic", "--link", link)
    aa, aa_steps = run(root / "acco-adaptive", args, "--strategy", "acco", "--accum", a, "--steps", steps,
                       "--link", link)
    slow = ",".join(["1"] * (args.workers - 1) + ["2"])
    z1s, z1s_steps = run(root / "zero1-slow", args, "--strategy", "zero1", "--accum", a, "--steps", steps,
                         "--link", link, "--slowdown", slow)
    acs, acs_steps = run(root / "acco-slow", args, "--strategy", "acco", "--accum", a, "--steps", steps,
                         "--link", link, "--slowdown", slow)

    rows = [("zero1", z1, z1_steps), ("acco (deterministic)", ac, ac_steps),
            ("acco (adaptive: accumulates while communicating)", aa, aa_steps),
            (f"zero1, slowdown {slow}", z1s, z1s_steps), (f"acco, slowdown {slow}", acs, acs_steps)]
    print(f"\nW={args.workers}, {args.model} GPT ({calib['params'] / 1e6:.2f}M params), link {link}, "
          f"{args.steps} steps x accum {args.accum} x micro-batch {args.micro_batch} x seq {args.seq_len}")
    print(f"{'run':48} {'us/token':>9} {'exposed':>8} {'tokens':>9} {'val loss':>9}")
    for name, summary, st in rows:
        print(f"{name:48} {per_token(st) * 1e6:9.1f} {100 * exposed_fraction(st):7.1f}% "
              f"{summary['tokens']:9,} {summary['final_val_loss']:9.4f}")

    ratio = per_token(ac_steps) / per_token(z1_steps)
    print(f"\nwall time per token acco / zero1:           {ratio:.3f}   (0.667 is the limit: every wait hidden)")
    print(f"   adaptive acco / zero1:                   {per_token(aa_steps) / per_token(z1_steps):.3f}")
    print(f"acco exposed communication:                 {100 * exposed_fraction(ac_steps):.1f}% deterministic, "
          f"{100 * exposed_fraction(aa_steps):.1f}% adaptive   (target <= 10%)")
    print(f"val loss at equal tokens and updates: zero1 {z1['final_val_loss']:.4f}, acco {ac['final_val_loss']:.4f}")
    print(f"slowdown {slow}: throughput acco / zero1 = {per_token(z1s_steps) / per_token(acs_steps):.3f} "
          f"(fast rank computed {acs['micro_batches_per_rank'][0]} micro-batches, slow rank "
          f"{acs['micro_batches_per_rank'][-1]})")
    print(f"acco memory over zero1: {ac['extra_memory_bytes_vs_zero1'] / 1e6:.2f} MB per rank "
          f"(optimizer state + master: acco {ac['optimizer_state_bytes_per_rank'] / 1e6:.2f} MB, "
          f"zero1 {z1['optimizer_state_bytes_per_rank'] / 1e6:.2f} MB)")
    print(f"runs kept in {root}" if args.keep else "")


if __name__ == "__main__":
    main()

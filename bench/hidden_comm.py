"""Communication hidden on a slow link: synchronous against one-step-delayed outer steps.

    python bench/hidden_comm.py                        # W=2, H=32, 3 periods (7.4 min on 2 quiet cores)
    python bench/hidden_comm.py --workers 4            # oversubscribes 2 cores: says so
    python bench/hidden_comm.py --periods 2 --keep runs/hidden

For ddp, diloco, streaming_diloco and sparseloco, each synchronous and (the local-SGD family)
with `--outer-delay 1`, one pair of runs side by side: on `--link` (default 10mbit,100ms) and
without a link, same model, micro-batch, tokens and seed. The pairs are interleaved (link,
no link, link, ...) so the machine's load drifts over both alike. Printed per variant: the
share of wall time exposed to communication on the link (the steps' waits over their wall
time), and tokens/s on the link / tokens/s without it (1.0 is perfect overlap; the final
sync of a run, which nothing can hide, is in both). And the validation loss of the delayed
diloco against the synchronous one at equal tokens, with its outer momentum 0 (the setting
PCCL runs it with; docs/strategies.md). Times are per-step wall times from steps.jsonl (the
slowest rank), the start-up excluded.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _runs import train

from lowcomm.metrics.calibration import cpu_cores, load, shared_cores

VARIANTS = [("ddp", "ddp", ()),
            ("diloco", "diloco", ()), ("diloco delayed", "diloco", ("--outer-delay", "1", "--outer-momentum", "0")),
            ("streaming_diloco", "streaming_diloco", ()),
            ("streaming_diloco delayed", "streaming_diloco", ("--outer-delay", "1", "--outer-momentum", "0")),
            ("sparseloco", "sparseloco", ()), ("sparseloco delayed", "sparseloco", ("--outer-delay", "1"))]
SKIP = 2  # first steps: start-up, allocator warm-up


def rates(steps: list[dict]) -> tuple[float, float]:
    """(tokens/s, exposed share of wall time) over the steps after the start-up."""
    kept = steps[SKIP:]
    wall = sum(s["wall_s"] for s in kept)
    return sum(s["tokens"] for s in kept) / wall, sum(s["exposed_comm_s"] for s in kept) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=32)
    ap.add_argument("--periods", type=int, default=3, help="outer periods per run (steps = periods x H)")
    ap.add_argument("--ddp-steps", type=int, default=8, help="ddp's steps per run (it syncs every step)")
    ap.add_argument("--link", default="10mbit,100ms")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--keep", help="keep the runs in this directory")
    args = ap.parse_args()
    start_load = load()
    busy = shared_cores(args.workers, cpu_cores(), start_load)  # the check `lowcomm plan` names it by
    if busy:
        print(f"note: {busy}: compute times include waiting for a core, and the no-link runs are slowed most")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lowcomm-bench-hidden-"))
    steps = str(args.periods * args.sync_every)
    common = ["--workers", str(args.workers), "--model", args.model, "--eval-every", "0"]
    rows = []
    for label, strategy, flags in VARIANTS:
        name = label.replace(" ", "-")
        # ddp sends every step, so a few of its steps tell its rate (on 10mbit one takes seconds)
        length = ["--steps", str(args.ddp_steps)] if strategy == "ddp" else \
            ["--steps", steps, "--sync-every", str(args.sync_every)]
        on = train(root / f"{name}-link", "--strategy", strategy, *common, *length, *flags, "--link", args.link)
        off = train(root / f"{name}-nolink", "--strategy", strategy, *common, *length, *flags, "--link", "inf,0")
        (rate_on, exposed), (rate_off, _) = rates(on.steps), rates(off.steps)
        rows.append((label, exposed, rate_on / rate_off, on.summary["final_val_loss"]))
        print(f"  {label}: exposed {100 * exposed:.1f} %, link / no link {rate_on / rate_off:.3f}", flush=True)
    print(f"\nW={args.workers}, {args.model} model, H={args.sync_every}, {steps} steps (ddp {args.ddp_steps}), "
          f"link {args.link}; "
          f"{cpu_cores()} cores, load {start_load:.1f} at the start, {load():.1f} at the end")
    print(f"{'variant':28} {'exposed share':>13} {'link/no-link':>13} {'val loss':>9}")
    for label, exposed, ratio, loss in rows:
        print(f"{label:28} {100 * exposed:12.1f}% {ratio:13.3f} {loss:9.4f}")
    print(f"runs kept in {root}" if args.keep else "")


if __name__ == "__main__":
    main()

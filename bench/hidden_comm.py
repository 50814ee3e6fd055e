"""Communication hidden on a slow link: synchronous, one-step-delayed and eager outer steps.

    python bench/hidden_comm.py                        # W=2, H=64, 4 periods, seeds 0 and 1
    python bench/hidden_comm.py --workers 4            # oversubscribes 2 cores: says so
    python bench/hidden_comm.py --model small --variants diloco --seeds 0 --periods 2
    python bench/hidden_comm.py --variants diloco,streaming_diloco --loss-periods 16 --loss-only   # losses, longer runs

For ddp, diloco, streaming_diloco and sparseloco, each synchronous and (the local-SGD family)
with `--outer-delay 1` and with `--outer-delay 1 --eager`, one pair of runs side by side: on
`--link` (default 10mbit,100ms) and without a link, same model, micro-batch, tokens and seed.
The pairs are interleaved (link, no link, link, ...) so the machine's load drifts over both
alike. Printed per variant: the share of wall time exposed to communication on the link (the
steps' waits over the run's training time), over the whole run and in the steady state (the
run's last step left out: its final sync has no inner step after it to hide behind, so a run
of P periods keeps about a P-th of one sync exposed whatever the overlap); tokens/s on the
link / tokens/s without it (1.0 is perfect overlap), likewise; and the validation loss, each
delayed and eager variant's relative to the synchronous diloco's of the same seed, with the
spread over the seeds; with `--loss-periods N`, the losses are those of one more run per variant
and seed, without a link, N periods long (the delay's cost is front-loaded: its first two periods
both start from θ_0, a half of a 4-period run's outer steps). The delayed and eager diloco
variants run with `--outer-momentum 0` (the setting PCCL runs the delay with; docs/strategies.md),
and "diloco momentum 0" is synchronous diloco with that outer optimizer, to tell the delay's
effect from the optimizer's. A run's training time is its longest rank's summed step times
(steps.jsonl's per_rank), the start-up steps excluded.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _runs import train

from lowcomm.metrics.calibration import cpu_cores, load, shared_cores

DELAYED, EAGER, PCCL = ("--outer-delay", "1"), ("--outer-delay", "1", "--eager"), ("--outer-momentum", "0")
VARIANTS = [("ddp", "ddp", ()),
            ("diloco", "diloco", ()), ("diloco momentum 0", "diloco", PCCL),
            ("diloco delayed", "diloco", (*DELAYED, *PCCL)),
            ("diloco eager", "diloco", (*EAGER, *PCCL)),
            ("streaming_diloco", "streaming_diloco", ()),
            ("streaming_diloco delayed", "streaming_diloco", (*DELAYED, *PCCL)),
            ("streaming_diloco eager", "streaming_diloco", (*EAGER, *PCCL)),
            ("sparseloco", "sparseloco", ()), ("sparseloco delayed", "sparseloco", DELAYED),
            ("sparseloco eager", "sparseloco", EAGER)]
SKIP = 2  # first steps: start-up, allocator warm-up


def rates(steps: list[dict], last: bool = True) -> tuple[float, float]:
    """(tokens/s, exposed share of the training time) over the steps after the start-up (and,
    `last` False, before the run's last step). The training time is the rank that took longest
    over those steps: the local-SGD family's ranks do not wait for each other between syncs, so
    the sum of each step's slowest rank would count twice the time they spend apart."""
    kept = steps[SKIP:] if last else steps[SKIP:-1]
    wall = max(map(sum, zip(*(s["per_rank"]["wall_s"] for s in kept))))
    return sum(s["tokens"] for s in kept) / wall, sum(s["exposed_comm_s"] for s in kept) / wall


def spread(values: list[float]) -> str:
    return f"{values[0]:+.1%}" if len(values) == 1 else f"{min(values):+.1%} .. {max(values):+.1%}"


def column(rows: list[dict], key: str, width: int, precision: str, unit: str = "") -> str:
    """The mean of `key` over `rows` (a share in percent where `unit` is %), or - where these runs
    did not measure it (--loss-only)."""
    if key not in rows[0]:
        return f"{'-':>{width + len(unit)}}"
    mean = sum(r[key] for r in rows) / len(rows) * (100 if unit == "%" else 1)
    return f"{mean:{width}{precision}}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=64)
    ap.add_argument("--periods", type=int, default=4, help="outer periods per run (steps = periods x H)")
    ap.add_argument("--ddp-steps", type=int, default=8, help="ddp's steps per run (it syncs every step)")
    ap.add_argument("--link", default="10mbit,100ms")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seeds", default="0,1", help="the seeds each variant runs at (losses: the spread)")
    ap.add_argument("--variants", help="comma-separated strategies (ddp, diloco, ...) whose variants run "
                                       "(default: all)")
    ap.add_argument("--loss-periods", type=int, default=0,
                    help="take the validation losses from one more no-link run of this many periods per "
                         "local-SGD variant and seed (0: from the timed runs)")
    ap.add_argument("--loss-only", action="store_true", help="with --loss-periods: only those runs, no timed pairs")
    ap.add_argument("--keep", help="keep the runs in this directory")
    args = ap.parse_args()
    if args.loss_only and not args.loss_periods:
        ap.error("--loss-only needs --loss-periods N")
    start_load = load()
    busy = shared_cores(args.workers, cpu_cores(), start_load)  # the check `lowcomm plan` names it by
    if busy:
        print(f"note: {busy}: compute times include waiting for a core, and the no-link runs are slowed most")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="lowcomm-bench-hidden-"))
    steps = str(args.periods * args.sync_every)
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = set(args.variants.split(",")) if args.variants else None
    variants = [v for v in VARIANTS if wanted is None or v[1] in wanted]
    common = ["--workers", str(args.workers), "--model", args.model, "--eval-every", "0"]
    rows = []
    for label, strategy, flags in variants:
        for seed in seeds:
            name = f"{label.replace(' ', '-')}-seed{seed}"
            row = {"label": label, "seed": seed}
            if not args.loss_only:
                # ddp sends every step, so a few of its steps tell its rate (on 10mbit one takes seconds)
                length = ["--steps", str(args.ddp_steps)] if strategy == "ddp" else \
                    ["--steps", steps, "--sync-every", str(args.sync_every)]
                run = [*common, *length, *flags, "--seed", str(seed)]
                on = train(root / f"{name}-link", "--strategy", strategy, *run, "--link", args.link)
                off = train(root / f"{name}-nolink", "--strategy", strategy, *run, "--link", "inf,0")
                (rate_on, exposed), (rate_off, _) = rates(on.steps), rates(off.steps)
                (steady_on, steady_exposed), (steady_off, _) = rates(on.steps, last=False), rates(off.steps, last=False)
                row |= {"exposed": exposed, "ratio": rate_on / rate_off, "steady_exposed": steady_exposed,
                        "steady_ratio": steady_on / steady_off, "loss": on.summary["final_val_loss"]}
                print(f"  {label} seed {seed}: exposed {100 * exposed:.1f} % ({100 * steady_exposed:.1f} % steady), "
                      f"link / no link {rate_on / rate_off:.3f} ({steady_on / steady_off:.3f} steady)", flush=True)
            if args.loss_periods and strategy != "ddp":
                longer = ["--steps", str(args.loss_periods * args.sync_every), "--sync-every", str(args.sync_every)]
                row["loss"] = train(root / f"{name}-loss", "--strategy", strategy, *common, *longer, *flags,
                                    "--seed", str(seed), "--link", "inf,0").summary["final_val_loss"]
                print(f"  {label} seed {seed}: val loss {row['loss']:.4f} after {args.loss_periods} periods", flush=True)
            if "loss" in row:
                rows.append(row)
    losses = f"; val losses of {args.loss_periods * args.sync_every}-step runs" if args.loss_periods else ""
    print(f"\nW={args.workers}, {args.model} model, H={args.sync_every}, {steps} steps (ddp {args.ddp_steps}){losses}, "
          f"link {args.link}, seeds {args.seeds}; "
          f"{cpu_cores()} cores, load {start_load:.1f} at the start, {load():.1f} at the end")
    sync = {r["seed"]: r["loss"] for r in rows if r["label"] == "diloco"}
    print(f"{'variant':26} {'exposed':>8} {'steady':>7} {'link/no-link':>12} {'steady':>7} {'val loss':>9} "
          f"{'vs diloco, same seed':>22}")
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        versus = [r["loss"] / sync[r["seed"]] - 1 for r in mine if r["seed"] in sync] if label != "diloco" else []
        print(f"{label:26} {column(mine, 'exposed', 7, '.1f', '%')} {column(mine, 'steady_exposed', 6, '.1f', '%')} "
              f"{column(mine, 'ratio', 12, '.3f')} {column(mine, 'steady_ratio', 7, '.3f')} "
              f"{column(mine, 'loss', 9, '.4f')} "
              f"{spread(versus) if versus else '':>22}")
    print(f"runs kept in {root}" if args.keep else "")


if __name__ == "__main__":
    main()

"""Does `lowcomm plan` predict what `lowcomm bench` measures? Emulated scenarios x every strategy.

    python bench/validate_plan.py --cases strategies    # W=2, tiny GPT, 12 steps per run, every strategy
    python bench/validate_plan.py --cases strategies --strategies ddp,zero1,acco,diloco --steps 24 --keep runs/validate

(bench/validate_plan.py runs this part with --cases strategies; its default is the knob and
replica cases.)

1. calibration: `lowcomm bench` of every strategy with no link cost (--link inf,0): each
   strategy's compute per token and its per-step work outside forward/backward
   (optimizer step, compression), and its loss per token;
2. scenarios (each a `lowcomm bench` with the same model, data, seed and steps):
   fast link 1gbit,1ms; slow link 50mbit,10ms; uneven workers 200mbit,5ms with --slowdown 1,2;
3. `lowcomm plan --calibrate <calibration> --steps S` with each scenario's link and slowdown
   predicts every strategy's step time averaged over the run (warm-up and final syncs
   included); the measured step time is the run's summed step wall time / steps (each
   step's slowest rank, evaluation excluded), as in the bench report. A second prediction
   takes compute from the scenario's own runs (`--calibrate <scenario>`): on a shared
   machine CPU speed drifts between runs, and this isolates the network and overlap model.

Printed: predicted / measured step time per case (target: within 15 %; measured = wall time
per token x the nominal tokens per step, so adaptive acco's extra micro-batches count per
token) and, per scenario, whether the strategy `plan` recommends (fastest predicted to the
scenario's median final loss) was the measured fastest to it. Exit 0 either way: this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIOS = {  # name: flags of `lowcomm bench` / `lowcomm plan`
    "fast link": ["--link", "1gbit,1ms"],
    "slow link": ["--link", "50mbit,10ms"],
    "uneven workers": ["--link", "200mbit,5ms", "--slowdown", "1,2"],
}
TARGET = 0.15


def lowcomm(*args: str, capture: bool = False) -> str:
    cmd = [sys.executable, "-m", "lowcomm", *args]
    print("  $ lowcomm", " ".join(args), flush=True)
    proc = subprocess.run(cmd, capture_output=capture, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: lowcomm {' '.join(args)} failed ({proc.returncode}):\n{(proc.stderr or '')[-2000:]}")
    return proc.stdout if capture else ""


def measured_step_s(run_dir: Path, tokens_per_step: int) -> float:
    """The run's training time per token, times the nominal tokens per step: the step time for
    every strategy but adaptive acco, which computes extra micro-batches while it waits (its
    rounds carry more tokens; per token it is compared like the others). The training time is
    the rank that took longest over all its steps (each rank's steps run back to back): not the
    sum of each step's slowest rank, which counts twice the time ranks that do not wait for each
    other every step (the local-SGD family between syncs) spend apart -- a fast rank's wait at a
    sync holds the steps the slow one computed meanwhile, already counted."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    tokens = sum(r["tokens"] for r in steps)
    if all("wall_s" in r.get("per_rank", {}) for r in steps):
        return max(map(sum, zip(*(r["per_rank"]["wall_s"] for r in steps)))) / tokens * tokens_per_step
    return sum(r["wall_s"] for r in steps) / tokens * tokens_per_step  # an older log: each step's slowest


def short_run_knobs(names: list[str], sync_every: int) -> list[str]:
    """Flags for short runs: a few syncs per run, and DPU's delayed updates and PowerSGD's
    compression starting early enough to be measured; each flag only where a strategy of
    `names` declares it."""
    from lowcomm.strategies import option_table
    table = option_table()
    wanted = {"--sync-every": sync_every, "--dpu-warmup": 2, "--powersgd-start": 2}
    return [word for flag, value in wanted.items() if set(names) & set(getattr(table.get(flag), "strategies", ()))
            for word in (flag, str(value))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="validate_plan.py --cases strategies", description=__doc__.split("\n")[0])
    ap.add_argument("--strategies", help="default: every registered strategy")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sync-every", type=int, default=4, help="H of the DiLoCo family (a few syncs per run)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--keep", metavar="DIR", help="keep the runs here (default: a temporary dir)")
    ap.add_argument("--scenarios", help=f"comma-separated subset of: {', '.join(SCENARIOS)}")
    ap.add_argument("--reuse", action="store_true", help="reuse the benches already complete under --keep "
                    "(their report.json exists): run only what is missing, then print the whole table")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a collective may hang before its run "
                    "fails (a hung strategy is reported as failed instead of holding the rest up)")
    args = ap.parse_args(argv)

    from lowcomm.strategies import available
    strategies = args.strategies or ",".join(available())
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="validate_plan-"))
    common = ["--strategies", strategies, "--workers", str(args.workers), "--steps", str(args.steps),
              "--model", args.model, "--micro-batch", str(args.micro_batch),
              "--eval-every", str(max(1, args.steps // 4)), "--eval-batches", "4", "--quiet", "--overwrite"]
    names = strategies.split(",")
    knobs = short_run_knobs(names, args.sync_every)
    common += knobs
    print(f"calibration (no link cost), then {len(SCENARIOS)} scenarios; runs under {root}", flush=True)
    common += ["--timeout", str(args.timeout)]
    scenarios = {n: SCENARIOS[n.strip()] for n in args.scenarios.split(",")} if args.scenarios else SCENARIOS

    def bench(out: Path, *flags: str) -> None:
        if not (args.reuse and (out / "report.json").is_file()):
            lowcomm("bench", *common, *flags, "--out", str(out))

    bench(root / "calibration", "--link", "inf,0")
    results = {}
    for name, flags in scenarios.items():
        out = root / name.replace(" ", "_")
        bench(out, *flags)
        report = json.loads((out / "report.json").read_text())
        # The bench's default target (the worst final loss) is reached by every run almost at once;
        # the median final loss separates the strategies.
        finals = sorted(r["final_val_loss"] for r in report["rows"] if r["status"] == "ok")
        report = json.loads(lowcomm("report", str(out), "--out", str(out / "median_target"), "--target-loss",
                                    str(finals[len(finals) // 2]), capture=True) and
                            (out / "median_target" / "report.json").read_text())
        ask = ["--strategies", strategies, "--workers", str(args.workers), "--steps", str(args.steps), *knobs,
               "--target-loss", str(report["target_loss"]), *flags, "--json"]
        plan = json.loads(lowcomm("plan", "--calibrate", str(root / "calibration"), *ask, capture=True))
        # The same prediction with compute taken from the scenario's own runs: on a shared
        # machine the CPU speed drifts between runs, and this isolates the network model.
        own = json.loads(lowcomm("plan", "--calibrate", str(out), *ask, capture=True))
        results[name] = (out, report, plan, {p["strategy"]: p for p in own["ranked"]})

    print(f"\nW={args.workers}, {args.model} GPT, {args.steps} steps per run, H={args.sync_every} for the "
          f"DiLoCo family; step time = summed step wall / steps\n")
    print(f"{'scenario':16} {'strategy':22} {'predicted':>9} {'measured':>9} {'pred/meas':>9} {'<=15%':>5}"
          f"   {'own-compute pred':>16} {'pred/meas':>9} {'<=15%':>5}")
    hits, own_hits, cases = 0, 0, 0
    for name, (out, report, plan, own) in results.items():
        nominal = plan["cluster"]["tokens_per_step"]

        def per_step(p):  # predicted seconds per nominal step's tokens (adaptive acco computes more)
            return nominal / p["tokens_per_s"]

        for p in sorted(plan["ranked"], key=lambda p: p["strategy"]):
            run = out / p["strategy"]
            if not (run / "summary.json").is_file():
                print(f"{name:16} {p['label']:22} {per_step(p):9.4f} {'failed':>9}")
                continue
            meas = measured_step_s(run, nominal)
            pred, own_pred = per_step(p), per_step(own[p["strategy"]])
            ratio, own_ratio = pred / meas, own_pred / meas
            cases += 1
            hits += abs(ratio - 1) <= TARGET
            own_hits += abs(own_ratio - 1) <= TARGET
            print(f"{name:16} {p['label']:22} {pred:9.4f} {meas:9.4f} {ratio:9.2f} "
                  f"{'yes' if abs(ratio - 1) <= TARGET else 'NO':>5}   {own_pred:16.4f} "
                  f"{own_ratio:9.2f} {'yes' if abs(own_ratio - 1) <= TARGET else 'NO':>5}")
    print(f"\nwithin 15%: {hits} of {cases} cases calibrated on the no-link runs; {own_hits} of {cases} with "
          f"each scenario's own measured compute")

    print("\nrecommendation vs measured fastest to the target loss")
    for name, (out, report, plan, _) in results.items():
        reached = [r for r in report["rows"] if r["status"] == "ok" and r["time_to_target_s"] is not None]
        fastest = min(reached, key=lambda r: r["time_to_target_s"]) if reached else None
        best = plan["ranked"][0]
        same = fastest is not None and fastest["label"] == best["strategy"]
        print(f"{name:16} target {report['target_loss']:.4f}: plan recommends {best['label']} "
              f"(predicted {best['time_to_target_s'] or float('nan'):.2f} s); measured fastest "
              f"{fastest['label'] if fastest else '-'} ({fastest['time_to_target_s'] if fastest else float('nan'):.2f} s)"
              f" -> {'same' if same else 'DIFFERENT'}")
        if not same and fastest is not None:
            mine = next((r for r in reached if r["label"] == best["strategy"]), None)
            if mine is not None:
                print(f"{'':16} the recommended one measured {mine['time_to_target_s']:.2f} s "
                      f"({mine['time_to_target_s'] / fastest['time_to_target_s']:.2f}x the fastest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does `lowcomm plan` predict the step time of a setting, and pick the fastest one?

    python bench/validate_plan.py --quick               # 3 scenarios, 8 settings: 7.5 min, 2 cores, load 10-17
    python bench/validate_plan.py                       # 5 scenarios, 19 settings: 17 min, load 10-13
    python bench/validate_plan.py --keep runs/validate --reuse   # print again, rerunning only what is missing
    python bench/validate_plan.py --cases strategies    # every strategy at its defaults on 3 links (see there)
    python bench/validate_plan.py --cases repeat        # one slow worker + slow link, calibrated 3 times (see there)

A scenario is a cluster (workers, --link, --intra-link) and the settings a user would choose
between there: a strategy with its knobs (the ones `lowcomm plan --tune` searches: H, bits,
PowerSGD rank, bucket size) and a replica size (--replicas, --inside ddp|fsdp). For each:

1. calibration: one `lowcomm train` per strategy of the scenario with no link cost, at the
   strategy's default knobs (what a user has before choosing them), run just before the
   scenario's settings: compute per token and per-step overhead;
2. measured: `lowcomm train` of the setting on the scenario's emulated links, step time =
   summed step wall time per token x the nominal tokens per step (evaluation excluded);
3. predicted: `lowcomm plan --config <the run's config> --calibrate <calibration run>
   --steps S` (the run's exact cluster and knobs, averaged over its S steps with warm-up and
   final syncs); a second prediction calibrates on the setting's own run, which takes CPU-speed
   drift between runs (and the knob's own compute cost) out and leaves the network model.

Printed: predicted / measured step time per setting; the median and worst step-time error;
and per scenario whether the setting the plan predicts fastest was the measured fastest,
or within --noise of it. Best means fastest per token here: loss per token is not judged
(16 steps of a tiny model cannot measure it), so for quality knobs (H, bits, rank) this
checks the plan's speed model, not the `--tune` policy that bounds them. Exit 0 either way:
this is a measurement, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _runs import train

from lowcomm.metrics.calibration import run_seconds_per_token
from lowcomm.metrics.runs import load_run

# A small GPT (435k parameters, 1.7 MB of fp32 gradients): a step computes in tens of ms on
# one loaded core, so the emulated links below decide, and a run is mostly process start-up.
MODEL = ["--n-layer", "2", "--n-head", "2", "--d-model", "128", "--seq-len", "64", "--micro-batch", "8"]
DILOCO = ["--strategy", "diloco"]


@dataclass(frozen=True)
class Scenario:
    name: str
    workers: int
    link: str               # --link: across replicas (every worker, where flat)
    settings: tuple         # (label, train flags): the choices
    quick: tuple = ()       # the labels --quick runs (none: the scenario is left out)
    intra_link: str = ""    # --intra-link, for the settings with replica groups (train refuses it flat)

    def cluster(self, flags) -> list[str]:
        grouped = self.intra_link and "--replicas" in flags
        return ["--link", self.link, *(["--intra-link", self.intra_link] if grouped else [])]


SCENARIOS = (
    Scenario("diloco H, 50mbit", 2, "50mbit,10ms", (
        ("ddp", ("--strategy", "ddp")),
        ("diloco H=2", (*DILOCO, "--sync-every", "2")),
        ("diloco H=4", (*DILOCO, "--sync-every", "4")),
        ("diloco H=8", (*DILOCO, "--sync-every", "8"))), quick=("ddp", "diloco H=2", "diloco H=8")),
    Scenario("compression knobs, 100mbit", 2, "100mbit,5ms", (
        ("quantized bits=8", ("--strategy", "quantized", "--bits", "8")),
        ("quantized bits=4", ("--strategy", "quantized", "--bits", "4")),
        ("powersgd rank=1", ("--strategy", "powersgd", "--powersgd-rank", "1", "--powersgd-start", "2")),
        ("powersgd rank=8", ("--strategy", "powersgd", "--powersgd-rank", "8", "--powersgd-start", "2")))),
    Scenario("ddp bucket, 1gbit", 2, "1gbit,2ms", (
        ("ddp bucket=0.25MB", ("--strategy", "ddp", "--bucket-mb", "0.25")),
        ("ddp bucket=25MB", ("--strategy", "ddp", "--bucket-mb", "25")))),
    Scenario("replica size, fast intra-link", 4, "20mbit,10ms", (
        ("ddp R=4 (flat)", ("--strategy", "ddp")),
        ("ddp R=2 ddp inside", ("--strategy", "ddp", "--replicas", "2", "--inside", "ddp")),
        ("ddp R=2 fsdp inside", ("--strategy", "ddp", "--replicas", "2", "--inside", "fsdp")),
        ("diloco H=4 R=4 (flat)", (*DILOCO, "--sync-every", "4")),
        ("diloco H=4 R=2", (*DILOCO, "--sync-every", "4", "--replicas", "2"))),
        quick=("ddp R=4 (flat)", "ddp R=2 ddp inside", "diloco H=4 R=2"),
        intra_link="1gbit,100us"),
    Scenario("replica size, equal links", 4, "200mbit,2ms", (
        ("ddp R=4 (flat)", ("--strategy", "ddp")),
        ("ddp R=2 ddp inside", ("--strategy", "ddp", "--replicas", "2", "--inside", "ddp")),
        ("ddp R=2 fsdp inside", ("--strategy", "ddp", "--replicas", "2", "--inside", "fsdp")),
        ("ddp R=1 (one replica)", ("--strategy", "ddp", "--replicas", "1"))),
        quick=("ddp R=4 (flat)", "ddp R=2 ddp inside"), intra_link="200mbit,2ms"),
)


@dataclass
class Result:
    scenario: str
    label: str
    measured_s: float
    predicted_s: float      # calibrated on the no-link run of the strategy at its defaults
    own_s: float            # calibrated on this run itself
    drift: float            # the calibration's compute per token / this run's, less 1

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def own_error(self) -> float:
        return self.own_s / self.measured_s - 1


def strategy_of(flags) -> str:
    return flags[list(flags).index("--strategy") + 1]


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def plan_step_s(run: Path, calibration: Path, steps: int) -> tuple[float, int]:
    """`lowcomm plan`'s step time for the run's own config, and its nominal tokens per step T:
    seconds per T tokens (a strategy that computes more while it waits is compared per token)."""
    from lowcomm.cli.main import main
    summary = json.loads((run / "summary.json").read_text())
    argv = ["plan", "--config", str(run / "config.toml"), "--calibrate", str(calibration),
            "--strategies", summary["strategy"], "--steps", str(steps), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code != 0:
        sys.exit(f"error: lowcomm {' '.join(argv)} failed: {err.getvalue().strip()}")
    plan = json.loads(out.getvalue())
    nominal = plan["cluster"]["tokens_per_step"]
    return nominal / plan["ranked"][0]["tokens_per_s"], nominal


def measured_step_s(run: Path, nominal: int) -> float:
    """Summed step wall time per token, times the nominal tokens per step."""
    records = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines() if line.strip()]
    return sum(r["wall_s"] for r in records) / sum(r["tokens"] for r in records) * nominal


def run_all(args, scenarios: list[Scenario], root: Path) -> list[Result]:
    common = [*MODEL, "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "2",
              "--timeout", str(args.timeout)]

    def run(out: Path, *flags: str) -> Path:
        if not (args.reuse and (out / "summary.json").is_file()):
            train(out, *common, *flags, "--overwrite", echo=True)
        return out

    results = []
    for s in scenarios:
        settings = chosen(s, args.quick)
        # the scenario's own no-link runs, just before its settings: on a shared machine the CPU
        # speed drifts over minutes, and a calibration taken long before measures another machine
        calibration = {name: run(root / slug(s.name) / f"calibration_{name}", "--workers", str(s.workers),
                                 "--strategy", name, "--link", "inf,0")
                       for name in dict.fromkeys(strategy_of(flags) for _, flags in settings)}
        for label, flags in settings:
            out = run(root / slug(s.name) / slug(label), "--workers", str(s.workers), *s.cluster(flags), *flags)
            predicted, nominal = plan_step_s(out, calibration[strategy_of(flags)], args.steps)
            own, _ = plan_step_s(out, out, args.steps)
            drift = (run_seconds_per_token(load_run(calibration[strategy_of(flags)]))
                     / run_seconds_per_token(load_run(out)))
            results.append(Result(s.name, label, measured_step_s(out, nominal), predicted, own, drift - 1))
    return results


def chosen(s: Scenario, quick: bool) -> list:
    return [(label, flags) for label, flags in s.settings if not quick or label in s.quick]


def report(results: list[Result], scenarios: list[Scenario], noise: float) -> str:
    """The markdown table, each scenario's pick against the measured fastest, and the summary figures."""
    lines = ["| scenario | setting | measured | predicted | error | CPU drift | own-compute pred. | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.scenario} | {r.label} | {1000 * r.measured_s:.0f} ms | {1000 * r.predicted_s:.0f} ms | "
                     f"{100 * r.error:+.0f} % | {100 * r.drift:+.0f} % | {1000 * r.own_s:.0f} ms | "
                     f"{100 * r.own_error:+.0f} % |")
    lines += ["", ("| scenario | measured fastest | plan picks | pick measured | verdict | own-compute plan picks "
              "| pick measured | verdict |"), "|---|---|---|---|---|---|---|---|"]
    hits = {"predicted_s": [0, 0], "own_s": [0, 0]}  # [the measured fastest, within noise of it]
    for s in scenarios:
        mine = [r for r in results if r.scenario == s.name]
        best = min(mine, key=lambda r: r.measured_s)
        row = [s.name, best.label]
        for key, count in hits.items():
            pick = min(mine, key=lambda r: getattr(r, key))
            slower = pick.measured_s / best.measured_s - 1
            count[0] += pick is best
            count[1] += slower <= noise
            row += [pick.label, f"+{100 * slower:.0f} %",
                    "same" if pick is best else f"within {100 * noise:.0f} %" if slower <= noise else "MISSED"]
        lines.append("| " + " | ".join(row) + " |")
    errors, own = [abs(r.error) for r in results], [abs(r.own_error) for r in results]
    worst, worst_own = max(results, key=lambda r: abs(r.error)), max(results, key=lambda r: abs(r.own_error))
    n = len(scenarios)
    lines += ["", (f"step-time error over {len(results)} settings: median {100 * statistics.median(errors):.1f} %, "
              f"worst {100 * abs(worst.error):.1f} % ({worst.scenario}: {worst.label}); with each run's own compute: "
              f"median {100 * statistics.median(own):.1f} %, worst {100 * abs(worst_own.own_error):.1f} % "
              f"({worst_own.scenario}: {worst_own.label}); CPU drift calibration vs run: median "
              f"{100 * statistics.median(abs(r.drift) for r in results):.0f} %"),
              (f"plan's pick = measured fastest in {hits['predicted_s'][0]} of {n} scenarios, within "
              f"{100 * noise:.0f} % of it in {hits['predicted_s'][1]} of {n}; with each run's own compute: "
              f"{hits['own_s'][0]} of {n}, within {100 * noise:.0f} % in {hits['own_s'][1]} of {n}")]
    return "\n".join(lines)


def main() -> int:
    cases = sys.argv[sys.argv.index("--cases") + 1:][:1] if "--cases" in sys.argv else []
    if cases in (["strategies"], ["repeat"]):
        import _validate_repeat
        import _validate_strategies
        i = sys.argv.index("--cases")
        run = _validate_strategies.main if cases == ["strategies"] else _validate_repeat.main
        return run(sys.argv[1:i] + sys.argv[i + 2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", choices=("settings", "strategies", "repeat"), default="settings",
                    help="settings: knobs and replica sizes (default); strategies: every strategy at its defaults; "
                         "repeat: one slow worker and a slow link, every strategy, calibrated three times")
    ap.add_argument("--quick", action="store_true", help="the scenarios and settings marked quick only")
    ap.add_argument("--scenarios", help=f"semicolon-separated subset of: {'; '.join(s.name for s in SCENARIOS)}")
    ap.add_argument("--steps", type=int, default=16, help="trainer steps per run (default: 16)")
    ap.add_argument("--noise", type=float, default=0.05, help="a pick this much slower than the measured "
                    "fastest counts as within noise (default: 0.05)")
    ap.add_argument("--keep", metavar="DIR", help="keep the runs here (default: a temporary dir)")
    ap.add_argument("--reuse", action="store_true", help="reuse the runs already complete under --keep")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a collective may hang before a run fails")
    args = ap.parse_args()
    names = [n.strip() for n in args.scenarios.split(";")] if args.scenarios else None
    unknown = set(names or ()) - {s.name for s in SCENARIOS}
    if unknown:
        sys.exit(f"error: unknown scenario {min(unknown)!r}")
    scenarios = [s for s in SCENARIOS if (names is None or s.name in names) and (not args.quick or s.quick)]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="validate_plan-"))
    print(f"{len(scenarios)} scenarios, {args.steps} steps per run; runs under {root}", flush=True)
    results = run_all(args, scenarios, root)
    print(f"\n{MODEL}, {args.steps} steps per run; step time = summed step wall time / steps\n")
    print(report(results, scenarios, args.noise))
    return 0


if __name__ == "__main__":
    sys.exit(main())

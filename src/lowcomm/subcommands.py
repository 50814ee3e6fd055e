"""`lowcomm bench`, `lowcomm report` and `lowcomm plan`: their flags and their glue.

bench and plan declare the run flags they use from flags.py (bench: all of train's but
--strategy and --resume; plan: those the planner reads), read by flags.config_from_args
as train's are, so a model, link, slowdown or strategy option is written the same way
everywhere, and each subcommand's --help lists only what it accepts. A strategy option
reaches the strategies that declare it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .errors import UsageError
from .flags import RUN_FLAGS, add_intra_link_flag, add_link_flag, add_run_flags, add_strategy_options, config_from_args, given
from .rundir import check_writable
from .values import convert, parse_count

# Train flags that only train takes: bench and plan declare them hidden, so that giving one is
# refused with a hint (cli._Parser.error) instead of reading as an unknown flag.
TRAIN_ONLY = {"--strategy": "use --strategies A,B,...", "--resume": "resume each run with lowcomm train --resume"}


def _hidden(parser: argparse.ArgumentParser, names) -> None:
    for name in names:
        parser.add_argument(name, help=argparse.SUPPRESS)


def _target_loss_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--target-loss", metavar="LOSS", help=f"validation loss (nats per token) for the "
                        f"time/bytes-to-target columns (default: {default})")


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    from .bench import DEFAULT_LINK, DEFAULT_STRATEGIES, DEFAULT_TOKENS

    bench.add_argument("recipe", nargs="?", metavar="RECIPE.toml", help="a bench recipe: labelled variants, a "
                       "baseline, seeds, a sweep (docs/comparing.md#recipes); the flags below then apply only "
                       "--out, --overwrite, --quiet, --target-loss (default: none: the strategies by the flags)")
    bench.add_argument("--check-targets", action="store_true", help="with a recipe: exit 3 when a variant misses "
                       "one of its targets (default: off; the report marks a miss either way)")
    bench.add_argument("--strategies", metavar="A,B,...", help=f"strategies to compare (default: "
                       f"{','.join(DEFAULT_STRATEGIES)}, those registered)")
    bench.add_argument("--tokens", metavar="N", help=f"training tokens per strategy, e.g. 2M (k, M, B; steps "
                       f"follow from each strategy's tokens per step; adaptive ones such as acco train more) "
                       f"(default: {DEFAULT_TOKENS:,}, unless --steps is given)")
    _target_loss_flag(bench, "the worst strategy's final loss")
    bench.add_argument("--config", metavar="FILE", help="TOML file of settings for every run; flags override it "
                       "(default: none)")
    add_run_flags(bench, [f for f in RUN_FLAGS if f != "--strategy"], helps={
        "--out": "bench directory: one run per strategy, report.md, plots (default: runs/bench-<time>)",
        "--steps": "trainer steps per strategy, instead of --tokens (default: from --tokens)",
        "--eval-every": "validate every STEPS trainer steps (default: an eighth of each run)"})
    add_link_flag(bench, default=DEFAULT_LINK)
    add_intra_link_flag(bench)
    bench.add_argument("--overwrite", action="store_true", help="replace a bench already in --out (default: off)")
    bench.add_argument("--quiet", action="store_true", help="no progress output (default: off)")
    add_strategy_options(bench)
    _hidden(bench, TRAIN_ONLY)


def add_report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("dirs", nargs="+", metavar="RUNDIR", help="run or bench directories")
    report.add_argument("--out", metavar="DIR", help="where to write report.md and the plots (default: the bench "
                        "dir when given one bench, else runs/report-<time>)")
    _target_loss_flag(report, "the worst run's final loss")


# train flags the planner reads
PLAN_FLAGS = ["--workers", "--replicas", "--inside", "--accum", "--micro-batch", "--steps", "--slowdown", "--model",
              "--n-layer", "--n-head", "--d-model", "--seq-len"]


def add_plan_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--params", metavar="N", help="model parameters, e.g. 1.3e9 or 350M (default: the --model's)")
    plan.add_argument("--worker-tflops", metavar="TFLOPS", help="sustained TFLOP/s of one worker (default: "
                      "measured, with --calibrate)")
    plan.add_argument("--tokens-per-step", metavar="N", help="tokens per step, all workers, e.g. 4M "
                      "(default: workers * accum * micro-batch * seq-len)")
    plan.add_argument("--strategies", metavar="A,B,...", help="strategies to plan (default: every registered one)")
    plan.add_argument("--calibrate", metavar="DIR", help="take each strategy's compute speed and loss per "
                      "token from a `lowcomm bench` dir (or one `lowcomm train` run dir); rank by predicted time "
                      "to the target loss (default: none)")
    _target_loss_flag(plan, "with --calibrate, the bench's worst final loss")
    plan.add_argument("--tune", action="store_true", help="also search each strategy's knobs (H, fragments, top-k, "
                      "bits, PowerSGD rank, max-accum, bucket size) over a small grid and report its best setting "
                      "next to its default; a knob that trades loss per token for speed (H, top-k, bits, rank, "
                      "max-accum) is kept at the most conservative setting within 5%% of the best tokens/s, unless "
                      "--calibrate measured its loss per token; with --intra-link and no --replicas the replica count "
                      "is searched with the knobs. The recommendation is then the best tuned setting, with its "
                      "`lowcomm train` command (default: off)")
    plan.add_argument("--max-sync-every", metavar="H", help="with --tune: the largest H (--sync-every) tried; "
                      "throughput alone always prefers a larger H (default: 64)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of the table (default: off)")
    plan.add_argument("--config", metavar="FILE", help="TOML file of settings; flags override it (default: none; "
                      "the bench's with --calibrate)")
    add_run_flags(plan, PLAN_FLAGS, helps={
        "--steps": "average over a run of this many trainer steps (warm-up, first syncs) instead of the steady "
                   "state (default: the steady state)",
        "--replicas": "price R replicas of W/R processes each: the strategy across replicas over --link, --inside "
                      "within each over --intra-link (default: W, flat; with --intra-link and no --replicas, every "
                      "R >= 2 dividing W, and the fastest recommended)"})
    add_link_flag(plan)
    add_intra_link_flag(plan, more="; without --replicas: try every replica count R >= 2 dividing W (R = W: flat) and "
                        "recommend one, taking the intra link to join any W/R workers")
    add_strategy_options(plan)
    _hidden(plan, TRAIN_ONLY)


def _join_arguments(parser: argparse.ArgumentParser) -> None:
    from .elastic.join import add_join_arguments
    add_join_arguments(parser)


SUBCOMMANDS = {  # name -> (one line for `lowcomm --help`, description, what declares its arguments)
    "bench": ("run several strategies side by side and report which to pick",
              "Train each strategy on the same model, data order, seed, workers, link and slowdowns (a train flag "
              "applies to every run; a strategy option to the strategies that have it), then write OUT/report.md "
              "(which run reached the target first, with fewest bytes, and which to pick), plots and the runs.",
              add_bench_arguments),
    "report": ("compare existing runs (report.md and plots)",
               "Build the bench report from run dirs (lowcomm train --out) or bench dirs.", add_report_arguments),
    "plan": ("predict step time, traffic and memory of every strategy on a cluster",
             "An analytic model of every strategy on a cluster: compute 6*N*tokens/FLOP/s (or measured with "
             "--calibrate), each strategy's communication plan priced by the link emulator's formulas, what it "
             "overlaps as it declares.", add_plan_arguments),
    "join": ("add one more worker to an elastic run that is training",
             "Join the elastic run in RUNDIR (lowcomm train --elastic --out RUNDIR) as one more worker: it takes "
             "the run's config.toml and the addresses its launcher published, receives the live state from a "
             "member at their next commit point and trains with them to the end of the run.", _join_arguments),
}


def _join(args) -> int:
    from .elastic.join import join
    return join(args)


def run_subcommand(args: argparse.Namespace) -> int:
    for flag, hint in TRAIN_ONLY.items():
        if getattr(args, flag[2:], None) is not None:
            raise UsageError(f"{flag} does not apply to lowcomm {args.command} ({hint})")
    return {"bench": _bench, "report": _report, "plan": _plan, "join": _join}[args.command](args)


def _target(args) -> float | None:
    if args.target_loss is None:
        return None
    value = convert(args.target_loss, "float", "--target-loss")
    if value <= 0:
        raise UsageError(f"--target-loss must be positive, got {args.target_loss}")
    return value


# -- bench ---------------------------------------------------------------------

def _bench(args) -> int:
    from . import config as C
    from .bench import DEFAULT_LINK, DEFAULT_TOKENS, parse_strategies, run_bench

    if args.recipe is not None:
        from .recipe.bench import bench_from_args
        return bench_from_args(args)
    if args.check_targets:
        raise UsageError("--check-targets applies to a recipe (lowcomm bench RECIPE.toml), whose runs have targets")
    cfg = config_from_args(args)
    if args.link is None and cfg.link.bandwidth is None and not args.config:
        C.set_link(cfg, DEFAULT_LINK)
    tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
    if tokens is None and not given(args, "--steps"):
        tokens = DEFAULT_TOKENS
    return run_bench(cfg, parse_strategies(args.strategies), tokens, _target(args),
                     eval_every_given=given(args, "--eval-every"), overwrite=args.overwrite, quiet=args.quiet)


# -- report --------------------------------------------------------------------

def _report(args) -> int:
    from .report import write_report
    from .report.runs import is_bench, load_bench, load_entries

    target = _target(args)
    entries = load_entries(args.dirs)
    # Not ./report: run inside a clone, that left a directory git did not ignore; runs/ is the outputs'.
    out = Path(args.out) if args.out else Path(args.dirs[0]) if len(args.dirs) == 1 and is_bench(
        Path(args.dirs[0])) else Path(f"runs/report-{time.strftime('%Y%m%d-%H%M%S')}")
    check_writable(out, "--out")
    recipe = load_bench(args.dirs[0]) if len(args.dirs) == 1 and is_bench(Path(args.dirs[0])) else None
    if recipe is not None and "recipe" in recipe.meta:  # its variants at their best settings, as the bench wrote
        from .report.recipe import write_recipe_report
        write_recipe_report(recipe, out, target)
    else:
        write_report(entries, out, target)
    print((out / "report.md").read_text().split("\n\n![")[0])
    print(f"\nreport: {out / 'report.md'} and plots in {out}/")
    return 0


# -- plan ----------------------------------------------------------------------

# More workers than any cluster built so far: the planner loops over workers, and at a
# million that takes ~10 s on 2 cores, at 1e8 minutes, so more is refused, not left to hang.
MAX_PLAN_WORKERS = 1_000_000


def _plan(args) -> int:
    from . import plan_assume, plan_pick, plan_text, plan_tune, planner, replica_sizes
    from .report.table import default_target

    bench, runs, from_bench = _calibration(args)
    cfg = _plan_config(args, calibrated=bench is not None)
    names, options = _plan_options(args, cfg, from_bench)
    cluster, dims, per_token = _plan_cluster(args, cfg, calibrated=bench is not None)
    target = _target(args)
    if bench is not None:
        target = target if target is not None else bench.meta.get("target_loss") or default_target(bench.entries)
    counts = replica_sizes.replica_counts(cfg, names if args.strategies is not None else None)
    by_count, left_out = {}, {}
    for R in counts:
        at = replace(cluster, replicas=R)
        planned, left_out[R] = replica_sizes.runs_at(names, cluster.layout, cfg.workers, R, cfg.inside,
                                                     strict=len(counts) == 1, named=args.strategies is not None)
        if planned:
            by_count[R] = planner.rank(_predict(args, cfg, at, planned, options, runs, per_token, target))
    best = [ranked[0] for ranked in by_count.values()]
    chosen = planner.rank(best)[0].replicas
    ranked, cluster = by_count[chosen], replace(cluster, replicas=chosen)
    why = planner.recommend(ranked, cluster)
    if replica_sizes.choosing(cfg):
        why = replica_sizes.recommend_count(best, cfg.workers) + "\n" + why
    assumed = plan_assume.assumptions(args, cfg, cluster, dims, per_token, runs)
    tuned = _tune(args, cfg, cluster, by_count, chosen, options, bench, runs, per_token, target)
    pick = None
    if tuned is not None:  # one answer: the tuned setting, not the given options, is the one to use
        pick, why = plan_pick.answer(tuned, by_count, cluster, cfg, replica_sizes.choosing(cfg))
    if args.json:
        from . import config as C
        links = C.to_dict(cfg)
        print(json.dumps({"cluster": {"params": cluster.params, "workers": cfg.workers, "tokens_per_step":
                                      cluster.tokens_per_step, "link": links["link"],
                                      "replicas": chosen, "inside": cfg.inside if chosen < cfg.workers else None,
                                      "intra_link": links["intra_link"],
                                      "slowdown": list(cfg.slowdown), "accum": cfg.accum,
                                      "steps": cfg.steps if given(args, "--steps") else None, "model": dims},
                          "target_loss": target, "ranked": [asdict(p) for p in ranked],
                          **({"replica_counts": [{"replicas": R, "ranked": [asdict(p) for p in r]}
                                                 for R, r in by_count.items()]} if replica_sizes.choosing(cfg) else {}),
                          "assumptions": assumed,
                          **({"tuned": [plan_tune.tuned_json(t) for t in tuned],
                              "recommended": plan_pick.recommended_json(pick, tuned, cfg)}
                             if tuned is not None else {}),
                          "recommendation": why}, indent=2))
    else:
        print(planner.describe_model(dims))
        print(plan_assume.describe(assumed))
        print(plan_text.plan_table(ranked, cluster, cfg, target, left_out[chosen]))
        if replica_sizes.choosing(cfg):
            print("\n" + plan_text.counts_table(best, cfg.workers))
        if tuned is not None:
            print("\n" + plan_tune.table(tuned, cfg.workers))
        print("\n" + why)
    return 0


def _calibration(args):
    """(the --calibrate bench or run, None without; its runs by strategy; whether the plan takes
    the cluster, model and batch from it: it does unless --config is given, and flags override them)."""
    from .report.runs import load_calibration

    bench = load_calibration(args.calibrate) if args.calibrate else None
    runs = {e.summary["strategy"]: e for e in bench.entries if hasattr(e, "summary")} if bench else {}
    if bench is not None and not runs:
        raise UsageError(f"bench '{args.calibrate}' has no finished run to calibrate from")
    from_bench = bench is not None and not args.config
    if from_bench:
        args.config = str(next(iter(runs.values())).path / "config.toml")
    return bench, runs, from_bench


def _tune(args, cfg, cluster, by_count, chosen, options, bench, runs, per_token, target):
    """`--tune`: each strategy's best setting (plan_tune.tune_all), its knobs searched together
    with every replica count it was planned at (`by_count`; `chosen` first); None without --tune."""
    from . import plan_tune

    def predict_one(name, opts, replicas):
        return _predict(args, cfg, replace(cluster, replicas=replicas), [name], {name: opts}, runs, per_token, None)[0]

    def counts_of(name):
        return tuple(sorted((R for R, ranked in by_count.items() if any(p.strategy == name for p in ranked)),
                            key=lambda R: R != chosen))
    names = list(dict.fromkeys(p.strategy for ranked in by_count.values() for p in ranked))
    return plan_tune.tune_all(args, names, options, cluster, bench, target, predict_one, counts_of)


def _plan_config(args, calibrated: bool):
    """The run config to plan, with the counts the planner needs checked (it does not validate
    the whole config: a plan needs no data, device or backend)."""
    cfg = config_from_args(args)
    if cfg.workers < 1:
        raise UsageError(f"workers must be at least 1, got {cfg.workers}")
    if cfg.workers > MAX_PLAN_WORKERS:
        raise UsageError(f"--workers {cfg.workers} is beyond what lowcomm plan models (at most {MAX_PLAN_WORKERS:,})")
    for name in ("accum", "micro_batch", "steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if calibrated and not given(args, "--slowdown") and len(cfg.slowdown) != cfg.workers:
        cfg.slowdown = ()  # the bench's slowdowns do not fit the planned --workers: plan equal workers
    if cfg.slowdown and len(cfg.slowdown) != cfg.workers:
        raise UsageError(f"slowdown has {len(cfg.slowdown)} factor(s) but there are {cfg.workers} workers")
    return cfg


def _plan_options(args, cfg, from_bench: bool) -> tuple[list[str], dict]:
    """The strategies to plan and each one's resolved options; an option none of them takes is refused."""
    from . import config as C
    from .bench import for_strategy, parse_strategies, unused_options
    from .strategies import available

    names = parse_strategies(args.strategies, default=available())
    options, used = {}, set()
    for name in names:
        one, fields = for_strategy(cfg, name)
        used |= fields
        options[name] = C.resolve_options(one)
    if from_bench:  # the run's own [<strategy>] table came with its config: no one asked for it
        used |= {f"[{name}]" for name in cfg.options}
    unused = unused_options(cfg, used)
    if unused:
        raise UsageError(f"{unused} applies to none of the strategies planned ({', '.join(names)})")
    return names, options


def _plan_cluster(args, cfg, calibrated: bool):
    """(the planner's Cluster, the model's dims, seconds per token of one 1x worker or None:
    from --worker-tflops, else measured per strategy by the calibrating bench)."""
    from . import config as C
    from . import planner

    model_flags = {k for k in planner.MODEL_KEYS if getattr(args, "model__" + k) is not None}
    asked = planner.size_model(cfg, args.params, model_flags) if args.params is not None else None
    layout = planner.model_layout(cfg)
    params, dims = layout.numel, planner.model_dims(cfg, layout, asked)
    tokens = parse_count(args.tokens_per_step, "--tokens-per-step") if args.tokens_per_step else cfg.tokens_per_step
    per_token = None
    if args.worker_tflops is not None:
        tflops = convert(args.worker_tflops, "float", "--worker-tflops")
        if tflops <= 0:
            raise UsageError(f"--worker-tflops must be positive, got {args.worker_tflops}")
        per_token = planner.flops_seconds_per_token(params, tflops * 1e12)
    elif not calibrated:
        raise UsageError("give --worker-tflops X (one worker's sustained TFLOP/s) or --calibrate BENCHDIR")
    cluster = planner.Cluster(layout, cfg.workers, tokens, 0.0, C.make_link(cfg), tuple(cfg.slowdown), cfg.accum,
                              intra_link=C.make_link(cfg, table="intra_link"), inside=cfg.inside)
    return cluster, dims, per_token


def _predict(args, cfg, cluster, names, options, runs, per_token, target) -> list:
    """Each strategy's prediction; a calibrating bench's runs give their measured speed (scaled
    to the planned model; the median for a strategy it did not run), overhead and time to target."""
    from . import planner
    from .report.runs import reach

    params = cluster.params
    measured = {n: r.seconds_per_token() * params / r.summary["params"] for n, r in runs.items()}
    fallback = sorted(measured.values())[len(measured) // 2] if measured else None
    preds = []
    for name in names:
        run = runs.get(name)
        scale = params / run.summary["params"] if run is not None else 1.0
        p = planner.predict(name, cluster, options[name], steps=cfg.steps if given(args, "--steps") else None,
                            seconds_per_token=per_token if per_token is not None else measured.get(name, fallback),
                            overhead_s=run.overhead_s() * scale if run is not None else 0.0)
        if run is not None and target is not None:
            p.tokens_to_target = reach(run.curve, target, "tokens")
            if p.tokens_to_target is not None:
                p.time_to_target_s = p.tokens_to_target / p.tokens_per_s
        preds.append(p)
    return preds


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `lowcomm bench|report|plan`")

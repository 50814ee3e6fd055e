"""`lowcomm plan`: its flags (those of train's the planner reads) and its glue: calibration from a
bench, the cluster, each strategy's prediction per replica count, --tune and the answer."""
from __future__ import annotations

import argparse
import json
import time
import sys
from dataclasses import asdict, replace

from ..config.flags import given
from ..contract.values import convert, parse_count
from ..errors import UsageError
from .flags import (TRAIN_ONLY, add_intra_link_flag, add_link_flag, add_run_flags, add_strategy_options,
                    config_from_args, hidden, target_loss, target_loss_flag)


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
    plan.add_argument("--calibrate", metavar="DIR", help="take the model's compute per micro-batch (one figure "
                      "for every strategy), each strategy's per-step work and its loss per token from a `lowcomm "
                      "bench` dir (or one `lowcomm train` run dir); rank by predicted time to the target loss "
                      "(default: none)")
    target_loss_flag(plan, "with --calibrate, the bench's worst final loss")
    plan.add_argument("--tune", action="store_true", help="also search each strategy's knobs (H, fragments, top-k, "
                      "bits, PowerSGD rank, max-accum, outer delay, bucket size) over a small grid and report its best setting "
                      "next to its default; a knob that trades loss per token for speed (H, top-k, bits, rank, "
                      "max-accum, outer delay) is kept at the most conservative setting within 5%% of the best tokens/s, unless "
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
    hidden(plan, TRAIN_ONLY)


# More workers than any cluster built so far: the planner loops over workers, and at a
# million that takes ~10 s on 2 cores, at 1e8 minutes, so more is refused, not left to hang.
MAX_PLAN_WORKERS = 1_000_000


def run(args) -> int:
    from ..plan import assume as plan_assume, pick as plan_pick, planner, replica_sizes
    from ..plan import text as plan_text, tune as plan_tune
    from ..bench.report.table import default_target

    bench, runs, from_bench, calibration = _calibration(args)
    cfg = _plan_config(args, calibrated=bench is not None)
    names, options = _plan_options(args, cfg, from_bench)
    cluster, dims, per_token = _plan_cluster(args, cfg, calibrated=bench is not None)
    target = target_loss(args)
    if bench is not None:
        target = target if target is not None else bench.meta.get("target_loss") or default_target(bench.entries)
    counts = replica_sizes.replica_counts(cfg, names if args.strategies is not None else None)
    by_count, left_out = {}, {}
    for R in counts:
        at = replace(cluster, replicas=R)
        planned, left_out[R] = replica_sizes.runs_at(names, cluster.layout, cfg.workers, R, cfg.inside,
                                                     strict=len(counts) == 1, named=args.strategies is not None)
        if planned:
            by_count[R] = planner.rank(_predict(args, cfg, at, planned, options, runs, calibration, per_token,
                                                target))
    best = [ranked[0] for ranked in by_count.values()]
    chosen = planner.rank(best)[0].replicas
    ranked, cluster = by_count[chosen], replace(cluster, replicas=chosen)
    why = planner.recommend(ranked, cluster)
    if replica_sizes.choosing(cfg):
        why = replica_sizes.recommend_count(best, cfg.workers) + "\n" + why
    assumed = plan_assume.assumptions(args, cfg, cluster, dims, per_token, runs, calibration)
    tuned = _tune(args, cfg, cluster, by_count, chosen, options, bench, (runs, calibration), per_token, target)
    pick = None
    if tuned is not None:  # one answer: the tuned setting, not the given options, is the one to use
        pick, why = plan_pick.answer(tuned, by_count, cluster, cfg, replica_sizes.choosing(cfg))
    if args.json:
        from .. import config as C
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
    the cluster, model and batch from it: it does unless --config is given, and flags override them;
    its Calibration: the model's compute and each strategy's per-step work, or None)."""
    from ..metrics.calibration import calibrate
    from ..metrics.runs import load_calibration

    bench = load_calibration(args.calibrate) if args.calibrate else None
    runs = {e.summary["strategy"]: e for e in bench.entries if hasattr(e, "summary")} if bench else {}
    if bench is not None and not runs:
        raise UsageError(f"bench '{args.calibrate}' has no finished run to calibrate from")
    from_bench = bench is not None and not args.config
    if from_bench:
        args.config = str(next(iter(runs.values())).path / "config.toml")
    return bench, runs, from_bench, calibrate(bench, runs) if bench is not None else None


def _tune(args, cfg, cluster, by_count, chosen, options, bench, measured, per_token, target):
    """`--tune`: each strategy's best setting (plan_tune.tune_all), its knobs searched together
    with every replica count it was planned at (`by_count`; `chosen` first); None without --tune."""
    from ..plan import tune as plan_tune

    def predict_one(name, opts, replicas):
        return _predict(args, cfg, replace(cluster, replicas=replicas), [name], {name: opts}, *measured, per_token,
                        None)[0]

    def counts_of(name):
        return tuple(sorted((R for R, ranked in by_count.items() if any(p.strategy == name for p in ranked)),
                            key=lambda R: R != chosen))
    names = list(dict.fromkeys(p.strategy for ranked in by_count.values() for p in ranked))
    return plan_tune.tune_all(args, names, options, cluster, bench, target, predict_one, counts_of,
                              _tuning_progress(cfg.workers // max(1, min(by_count, default=1)), len(names)))


# A replica of this many ranks or more is priced position by position for every setting --tune
# tries: seconds per strategy at ten thousand, minutes for all of them at a million (one core).
SAY_TUNING_AT = 10_000


def _tuning_progress(ranks_per_replica: int, strategies: int):
    """What `--tune` says while it searches: nothing for a small cluster; for a large one, a line
    at once that it will take a while, then one as each strategy is done (to stderr)."""
    if ranks_per_replica < SAY_TUNING_AT:
        return lambda name, i, n: None
    print(f"lowcomm plan: --tune prices each of up to {ranks_per_replica:,} ranks of a replica for every "
          f"setting of {strategies} strategies: this may take minutes; a line as each is done",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    return lambda name, i, n: print(f"  tuned {name} ({i} of {n}, {time.monotonic() - start:.0f} s)",
                                    file=sys.stderr, flush=True)


def _plan_config(args, calibrated: bool):
    """The run config to plan, with the counts the planner needs checked (it does not validate
    the whole config: a plan needs no data, device or backend)."""
    from .. import config as C

    cfg = config_from_args(args)
    if cfg.workers < 1:
        raise UsageError(f"{C.spelled(cfg, 'workers')} must be at least 1, got {cfg.workers}")
    if cfg.workers > MAX_PLAN_WORKERS:
        raise UsageError(f"--workers {cfg.workers} is beyond what lowcomm plan models (at most {MAX_PLAN_WORKERS:,})")
    for name in ("accum", "micro_batch", "steps"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"{C.spelled(cfg, name)} must be at least 1, got {getattr(cfg, name)}")
    if calibrated and not given(args, "--slowdown") and len(cfg.slowdown) != cfg.workers:
        cfg.slowdown = ()  # the bench's slowdowns do not fit the planned --workers: plan equal workers
    if cfg.slowdown and len(cfg.slowdown) != cfg.workers:
        raise UsageError(f"{C.spelled(cfg, 'slowdown')} has {len(cfg.slowdown)} factor(s) but there are {cfg.workers} "
                         f"workers ({C.spelled(cfg, 'workers', cfg.workers)})")
    return cfg


def _plan_options(args, cfg, from_bench: bool) -> tuple[list[str], dict]:
    """The strategies to plan and each one's resolved options; an option none of them takes is refused."""
    from .. import config as C
    from ..bench.compare import for_strategy, parse_strategies, unused_options
    from ..strategies import available

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
    from .. import config as C
    from ..plan import planner

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
                              intra_link=C.make_link(cfg, table="intra_link"), inside=cfg.inside,
                              seq_len=cfg.model.seq_len)
    return cluster, dims, per_token


def _predict(args, cfg, cluster, names, options, runs, calibration, per_token, target) -> list:
    """Each strategy's prediction; a calibration gives the model's compute (one figure for every
    strategy, scaled to the planned model), each strategy's per-step work (0 for one it did not
    run) and, from its runs, the time to target."""
    from ..plan import planner
    from ..metrics.runs import reach

    params = cluster.params
    if per_token is None:
        per_token = calibration.seconds_per_token(params)
    preds = []
    for name in names:
        run = runs.get(name)
        work = calibration.work[name].total_s * params / run.summary["params"] if run is not None else 0.0
        p = planner.predict(name, cluster, options[name], steps=cfg.steps if given(args, "--steps") else None,
                            seconds_per_token=per_token, overhead_s=work)
        if run is not None and target is not None:
            p.tokens_to_target = reach(run.curve, target, "tokens")
            if p.tokens_to_target is not None:
                p.time_to_target_s = p.tokens_to_target / p.tokens_per_s
        preds.append(p)
    return preds


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run `lowcomm bench|report|plan`")

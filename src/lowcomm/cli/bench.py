"""`lowcomm bench`: its flags (all of train's but --strategy and --resume, read as train's are)
and its glue, for strategies given by flags or a recipe."""
from __future__ import annotations

import argparse

from ..config.flags import RUN_FLAGS, given
from ..contract.values import parse_count
from ..errors import UsageError
from .flags import (TRAIN_ONLY, add_intra_link_flag, add_link_flag, add_run_flags, add_strategy_options,
                    config_from_args, hidden, target_loss, target_loss_flag)


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    from ..bench.compare import DEFAULT_LINK, DEFAULT_STRATEGIES, DEFAULT_TOKENS

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
    bench.add_argument("--repeats", metavar="N", help="run every strategy N times, in interleaved rounds "
                       "(A B C, C B A, ...), and compare them round by round: fair on a machine other jobs share "
                       "(default: 1)")
    target_loss_flag(bench, "the worst strategy's final loss")
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
    hidden(bench, TRAIN_ONLY)


def run(args) -> int:
    from .. import config as C
    from ..bench.compare import DEFAULT_LINK, DEFAULT_TOKENS, parse_repeats, parse_strategies, run_bench

    if args.recipe is not None:
        return _recipe(args)
    if args.check_targets:
        raise UsageError("--check-targets applies to a recipe (lowcomm bench RECIPE.toml), whose runs have targets")
    repeats = parse_repeats(args.repeats)
    cfg = config_from_args(args)
    if args.link is None and cfg.link.bandwidth is None and not args.config:
        C.set_link(cfg, DEFAULT_LINK)
    tokens = parse_count(args.tokens, "--tokens") if args.tokens is not None else None
    if tokens is None and not given(args, "--steps"):
        tokens = DEFAULT_TOKENS
    return run_bench(cfg, parse_strategies(args.strategies), tokens, target_loss(args),
                     eval_every_given=given(args, "--eval-every"), overwrite=args.overwrite, quiet=args.quiet,
                     repeats=repeats)


def _recipe(args) -> int:
    """`lowcomm bench RECIPE.toml`: the recipe alone says what runs (a run flag is refused)."""
    from ..bench.recipe.bench import RECIPE_FLAGS, run_recipe
    from ..bench.recipe.read import load_recipe
    from ..config.flags import dest, option_dest
    from ..strategies import option_table

    names = {dest(f.key): n for n, f in RUN_FLAGS.items()} | {option_dest(o.field): n for n, o in option_table().items()}
    for key, value in vars(args).items():
        if key not in RECIPE_FLAGS and value not in (None, False):
            flag = names.get(key, "--" + key.replace("_", "-"))
            if key == "repeats":  # not a setting: a recipe repeats its runs over seeds
                raise UsageError(f"--repeats does not apply with a recipe: {args.recipe} repeats each run at "
                                 f"every seed of its seeds = [...]")
            raise UsageError(f"{flag} does not apply with a recipe: set it in {args.recipe}, where it reaches every run")
    return run_recipe(load_recipe(args.recipe), args.out or "", target_loss(args), args.overwrite, args.quiet,
                      args.check_targets)

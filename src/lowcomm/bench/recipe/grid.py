"""A recipe's grid: one validated RunConfig per variant, swept value and seed, each in its
own directory of the bench (OUT/<label>/<key>=<value>,seed=<seed>; OUT/<label> when the
recipe sweeps nothing and has one seed, as `lowcomm bench --strategies` lays a bench out)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from ... import config as C
from ..compare import DEFAULT_LINK, DEFAULT_TOKENS, EVAL_POINTS, Planned
from ...errors import UsageError
from . import keys
from .read import Recipe, Variant


@dataclass
class Point:
    """One cell of a variant's grid: its swept values (key as written -> value) and its seed."""
    values: dict
    seed: int

    def words(self, with_seed: bool = True) -> str:
        """'lr=0.001,seed=0': the point as a directory name and in the report."""
        parts = [f"{k}={shown(v)}" for k, v in self.values.items()] + ([f"seed={self.seed}"] if with_seed else [])
        return ",".join(parts)


def shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def points(variant: Variant, seeds: list[int]) -> list[Point]:
    """The variant's grid in the order it runs: every combination of its swept values, each at every seed."""
    names = list(variant.sweep)
    return [Point(dict(zip(names, combo)), seed)
            for combo in itertools.product(*(variant.sweep[k] for k in names)) for seed in seeds]


# A bench trains its runs one after another, each for minutes (seconds for the smallest), and
# checks every one first (about a second each on a loaded 2-core machine): a thousand runs is
# days of training already; a larger grid is a typo or a recipe to split, refused at once.
MAX_RUNS = 1000


def grid_size(recipe: Recipe) -> int:
    """How many runs the recipe's grid holds (without laying it out: it may be millions)."""
    return len(recipe.seeds) * sum(math.prod(len(values) for values in v.sweep.values()) for v in recipe.variants)


def check_size(recipe: Recipe) -> int:
    """The grid's run count; UsageError, with the limit and why, when it is beyond MAX_RUNS."""
    runs = grid_size(recipe)
    if runs > MAX_RUNS:
        largest = max(recipe.variants, key=lambda v: math.prod(len(values) for values in v.sweep.values()))
        swept = " x ".join(f"{len(values):,} {key}" for key, values in largest.sweep.items())
        raise UsageError(f"recipe {recipe.path} has {runs:,} runs ([[run]] '{largest.label}': "
                         f"{swept or 'no sweep'} x {len(recipe.seeds):,} seeds); a bench trains them one after "
                         f"another, each for minutes, so it takes at most {MAX_RUNS:,}: sweep fewer values or "
                         f"split the recipe")
    return runs


def plan_grid(recipe: Recipe, out: Path, overwrite: bool) -> list[Planned]:
    """Every run of the recipe, validated as `lowcomm train` validates one (UsageError naming the
    variant and the file before anything is written)."""
    from ...launch.launcher import prepare

    check_size(recipe)
    planned = []
    one_cell = len(recipe.seeds) == 1
    for variant in recipe.variants:
        for point in points(variant, recipe.seeds):
            sub = point.words(with_seed=not one_cell)
            where = variant.label + ("/" + sub if sub else "")
            try:
                cfg = run_config(recipe, variant, point)
                cfg.out = str(out / where)
                prepare(cfg, create=False, overwrite=overwrite)
            except UsageError as e:
                raise UsageError(f"{e} (in [[run]] '{variant.label}'{' at ' + sub if sub else ''} of "
                                 f"{recipe.path})") from None
            planned.append(Planned(f"{variant.label} {sub}".strip(), cfg, dir=where,
                                   extra={"variant": variant.label, "point": point.values, "seed": point.seed}))
    return planned


def run_config(recipe: Recipe, variant: Variant, point: Point) -> C.RunConfig:
    """The recipe's settings that reach this variant, then its own, then the point's values;
    steps from the recipe's tokens and an evaluation every eighth of the run unless set."""
    cfg = C.RunConfig(strategy=variant.strategy)
    given = {}
    # The recipe's settings reach the runs whose strategy has them (as a flag reaches the strategies
    # of `lowcomm bench --strategies`); a run's own keys and sweep were checked to be its strategy's.
    shared = [(k, v) for k, v in recipe.settings.items() if keys.applies_to(k, variant.strategy) and k != "strategy"]
    for key, value in [*shared, *variant.settings.items(), *point.values.items()]:
        keys.apply(cfg, key, value)
        given[keys.canonical(key)] = value
    cfg.seed = point.seed
    if not any(k.split(".")[0] in keys.LINKS for k in given):  # as `lowcomm bench`: a slow link
        C.set_link(cfg, DEFAULT_LINK)
    tokens = recipe.tokens if recipe.tokens is not None or "steps" in given else DEFAULT_TOKENS
    if tokens is not None and cfg.tokens_per_step > 0:  # (not: validation names the bad count)
        cfg.steps = max(1, math.ceil(tokens / cfg.tokens_per_step))
    if "eval_every" not in given:
        cfg.eval_every = max(1, cfg.steps // EVAL_POINTS)
    return cfg

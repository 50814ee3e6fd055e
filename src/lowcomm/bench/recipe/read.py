"""Reading a bench recipe: what `lowcomm bench RECIPE.toml` compares, checked whole before
anything runs. Every error is one line naming the bad key and the file (exit 2).

    steps = 300               # any `lowcomm train` key: it applies to every run
    workers = 4
    baseline = "ddp"          # the label the others are compared with (default: the first run)
    seeds = [0, 1]            # every run at each seed (default: the `seed` key's, 0)
    tokens = "2M"             # as --tokens: steps follow from each run's tokens per step
    [sweep]
    lr = [1e-3, 2e-3, 4e-3]   # every run at each value (a strategy option: the runs that have it)
    [[run]]
    label = "int8+ef"
    strategy = "quantized"
    bits = 8                  # any train key or option of the strategy, for this run only
    [run.sweep]               # this run's own grid: replaces [sweep]'s values of the same key
    [run.targets]             # optional: what this variant must reach at its best setting
    max_loss_gap = 0.005      # (TARGETS); the report marks a miss, --check-targets exits 3 on one

Only the shape and the names are checked here; grid.py builds and validates each run's config.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ... import config as C
from ...errors import UsageError
from ...strategies import available
from ...contract.values import parse_count
from . import keys

# Keys of the recipe itself; every other top-level key is a `lowcomm train` setting.
RECIPE_KEYS = ("baseline", "seeds", "tokens", "target_loss", "description", "out", "sweep", "run")
RUN_KEYS = ("label", "strategy", "sweep", "targets")  # a [[run]]'s own; the rest are settings
# Settings the bench decides for each run, so a recipe cannot set them per run or sweep them.
BENCH_OWNED = {"out": "the bench puts each run in OUT/<label>/", "seed": "use seeds = [...]",
               "strategy": "give each strategy its own [[run]]"}
# target name -> (what it bounds, True when the figure must stay at or below the limit)
TARGETS = {
    "max_loss_gap": ("validation loss vs the baseline's, as a fraction (0.03: at most 3 % above)", True),
    "min_bytes_reduction": ("the baseline's bytes per token / this variant's", False),
    "min_speedup": ("tokens/s / the baseline's", False),
    "max_val_loss": ("final validation loss", True),
}


@dataclass
class Variant:
    label: str
    strategy: str
    settings: dict[str, Any]         # its own keys, flattened ('model.n_layer')
    sweep: dict[str, list]           # key as written -> values: [sweep]'s that reach it, then its own
    targets: dict[str, float] = field(default_factory=dict)


@dataclass
class Recipe:
    path: Path
    text: str
    settings: dict[str, Any]         # top-level train keys, flattened
    variants: list[Variant]
    baseline: str
    seeds: list[int]
    tokens: int | None
    target_loss: float | None
    description: str = ""
    out: str = ""

    def where(self, part: str = "") -> str:
        return f"{part + ' of ' if part else ''}{self.path}"


def load_recipe(path: str | Path) -> Recipe:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise UsageError(f"recipe '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"recipe '{path}' cannot be read: {e.__class__.__name__}") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"recipe '{path}' is not valid TOML: {e}") from None
    runs = data.get("run")
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
        raise UsageError(f"recipe {p} has no [[run]] (each run: label = \"...\", strategy = \"...\", its options)")
    settings = {k: v for k, v in keys.flatten({k: v for k, v in data.items() if k not in RECIPE_KEYS})}
    _check_settings(settings, p, "")
    if "seed" in settings and "seeds" in data:
        raise UsageError(f"recipe {p} gives both seed and seeds (keep seeds = [...])")
    sweep = _sweep(data.get("sweep", {}), p, "[sweep]")
    variants = [_variant(i, run, settings, sweep, p) for i, run in enumerate(runs, 1)]
    _check_reach(settings, sweep, variants, p)
    labels = [v.label for v in variants]
    twice = next((label for label in labels if labels.count(label) > 1), None)
    if twice is not None:
        raise UsageError(f"two [[run]]s are labelled '{twice}' in {p} (give each its own label)")
    baseline = data.get("baseline", labels[0])
    if baseline not in labels:
        raise UsageError(f"baseline '{baseline}' in {p} is not a [[run]]'s label (labels: {', '.join(labels)})")
    return Recipe(p, text, settings, variants, baseline, _seeds(data, settings, p),
                  parse_count(data["tokens"], f"tokens in {p}") if "tokens" in data else None,
                  _target_loss(data, p), str(data.get("description", "")), str(data.get("out", "")))


def _check_settings(settings: dict, path: Path, part: str, scratch: C.RunConfig | None = None) -> None:
    """Each key names a setting and its value has the setting's type (ranges: grid.py, per run)."""
    scratch = scratch or C.RunConfig()
    for key, value in settings.items():
        head = key.split(".")[0]
        if part and head in BENCH_OWNED:
            raise UsageError(f"{key} cannot be set in {part} of {path} ({BENCH_OWNED[head]})")
        try:
            keys.apply(scratch, key, value)
        except UsageError as e:
            raise UsageError(f"{e} in {part + ' of ' if part else ''}{path}"
                             + ("" if part else f" (a recipe's keys: lowcomm train's, and {', '.join(RECIPE_KEYS)})")
                             ) from None


def _sweep(table: Any, path: Path, part: str) -> dict[str, list]:
    if not isinstance(table, dict):
        raise UsageError(f"{part} in {path} must be a table of lists, e.g. lr = [1e-3, 2e-3]")
    out = {}
    for key, values in keys.flatten(table):
        if not isinstance(values, list) or not values:
            raise UsageError(f"{part} {key} in {path} must be a non-empty list of values, e.g. {key} = [1, 2]")
        if len(set(map(repr, values))) != len(values):
            raise UsageError(f"{part} {key} in {path} lists a value twice")
        if key.split(".")[0] in BENCH_OWNED:
            raise UsageError(f"{key} cannot be swept in {part} of {path} ({BENCH_OWNED[key.split('.')[0]]})")
        for value in values:  # the key exists and each value has its type
            try:
                keys.apply(C.RunConfig(), key, value)
            except UsageError as e:
                raise UsageError(f"{e} in {part} of {path}") from None
        out[key] = values
    return out


def _variant(i: int, run: dict, settings: dict, sweep: dict, path: Path) -> Variant:
    label = str(run.get("label", run.get("strategy", "")))
    part = f"[[run]] '{label}'" if label else f"[[run]] {i}"
    strategy = run.get("strategy", settings.get("strategy"))
    if strategy is None:
        raise UsageError(f"{part} of {path} names no strategy (strategy = \"...\")")
    if strategy not in available():
        raise UsageError(f"unknown strategy '{strategy}' in {part} of {path} "
                         f"(choose from: {', '.join(sorted(available()))})")
    if not label.strip() or label.strip() != label or "/" in label or label in (".", ".."):
        raise UsageError(f"{part} of {path} has label '{label}': a label must be a non-empty name without '/' "
                         f"or surrounding spaces")
    own = dict(keys.flatten({k: v for k, v in run.items() if k not in RUN_KEYS}))
    _check_settings(own, path, part)
    grid = {k: v for k, v in sweep.items() if keys.applies_to(k, strategy)}
    own_sweep = _sweep(run.get("sweep", {}), path, f"{part} sweep")
    for key in [*own, *own_sweep]:
        if not keys.applies_to(key, strategy):
            raise UsageError(f"{key} in {part} of {path} is not an option of {strategy} "
                             f"(it is one of: {', '.join(keys.owners(key)) or 'none'})")
    fixed = {keys.canonical(k) for k in own}  # a value the run sets itself is not swept for it
    grid = {k: v for k, v in grid.items() if keys.canonical(k) not in fixed | {keys.canonical(o) for o in own_sweep}}
    grid.update(own_sweep)
    return Variant(label, strategy, own, grid, _targets(run.get("targets", {}), path, part))


def _check_reach(settings: dict, sweep: dict, variants: list[Variant], path: Path) -> None:
    """A strategy option set or swept for every run must reach one of them: nothing is silently dropped."""
    for where, table in (("", settings), ("[sweep] ", sweep)):
        for key in table:
            if not any(keys.applies_to(key, v.strategy) for v in variants):
                raise UsageError(f"{where}{key} in {path} applies to none of the runs' strategies "
                                 f"({', '.join(sorted({v.strategy for v in variants}))})")


def _targets(table: Any, path: Path, part: str) -> dict[str, float]:
    if not isinstance(table, dict):
        raise UsageError(f"targets of {part} in {path} must be a table, e.g. targets = {{ max_loss_gap = 0.01 }}")
    out = {}
    for key, value in table.items():
        if key not in TARGETS:
            raise UsageError(f"unknown target '{key}' in {part} of {path} (targets: {', '.join(TARGETS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"target {key} in {part} of {path} must be a number, got {value!r}")
        out[key] = float(value)
    return out


def _seeds(data: dict, settings: dict, path: Path) -> list[int]:
    seeds = data.get("seeds", [settings.get("seed", C.RunConfig.seed)])
    if not isinstance(seeds, list) or not seeds or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise UsageError(f"seeds in {path} must be a non-empty list of non-negative integers, e.g. seeds = [0, 1]")
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"seeds in {path} lists a seed twice")
    return seeds


def _target_loss(data: dict, path: Path) -> float | None:
    value = data.get("target_loss")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UsageError(f"target_loss in {path} must be a positive number, got {value!r}")
    return float(value)

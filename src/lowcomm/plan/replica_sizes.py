"""`lowcomm plan` with replica groups: which replica counts R it prices, which strategies run at
each, and which R it recommends.

`--replicas R` prices that one R, refused as `lowcomm train` refuses it (engines/inside.py's
check_replicas: R must divide W, the strategy must run under --inside, --intra-link needs
R < W). `--intra-link` without `--replicas` asks which R to use: every R >= 2 dividing W is
priced (R = W is the flat cluster, where the intra link carries nothing) and the fastest
(strategy, R) is picked by the same order the table ranks strategies by (planner.rank).
R = 1 is left out: one replica has no level across, so the --link the cluster was described
with would join nothing. The model takes the intra link to join any K = W/R ranks; where it
spans only a node's ranks, give that as --replicas W/K instead of asking.
"""
from __future__ import annotations

import copy

from ..errors import UsageError
from .levels import divisors, fits
from .planner import Prediction, format_seconds, named, rank
from ..strategies import available
from ..strategies import get as get_strategy
from ..config.checks import check_replicas


def choosing(cfg) -> bool:
    """Whether the plan is to recommend R: an --intra-link without --replicas (or replicas = 0)."""
    return cfg.replicas == 0 and cfg.intra_link.bandwidth is not None


def replica_counts(cfg, named: list[str] | None) -> list[int]:
    """The replica counts to price, largest first; UsageError (one line) for what train would
    refuse. `named`: the strategies the user listed (each must run with --replicas R < W), None:
    the default list (those that do not are left out at R < W, see runs_at)."""
    supported = [n for n in available() if get_strategy(n).runs_inside(cfg.inside)]
    probe = copy.copy(cfg)
    # recommending: R = 1 stands for every R < W (it divides W, and refuses --intra-link for W = 1)
    probe.replicas = 1 if choosing(cfg) else cfg.replicas
    # a strategy to check the rest with, where none was named (it must not be the one refused)
    for name in named if named is not None and not choosing(cfg) else (supported or available())[:1]:
        probe.strategy = name
        check_replicas(probe, supported)
    if choosing(cfg):
        return [R for R in divisors(cfg.workers) if R >= 2 or R == cfg.workers]
    return [cfg.replicas or cfg.workers]


def runs_at(names: list[str], layout, workers: int, replicas: int, inside: str,
            strict: bool = False, named: bool = False) -> tuple[list[str], dict[str, str]]:
    """The strategies of `names` that run as `replicas` replicas, and why each other one does not.
    `strict` (the one R the user asked for): UsageError where one of `names` does not run there
    and the user `named` them, or where none of them does."""
    if replicas == workers:
        return list(names), {}
    size, kept, left = workers // replicas, [], {}
    for name in names:
        cls = get_strategy(name)
        if not cls.runs_inside(inside):
            left[name] = f"does not run across replica groups with --inside {inside}"
        elif not fits(cls, layout, size):
            left[name] = (f"a replica of {size} ranks has more ranks than the model has tensors "
                          f"({len(layout.shapes)}): each rank must own one")
        else:
            kept.append(name)
    where = f"--replicas {replicas} of --workers {workers}"
    if strict and named and left:
        name, why = next(iter(left.items()))
        raise UsageError(f"strategy '{name}' cannot be planned with {where}: {why}")
    if strict and not kept:
        reasons = "; ".join(f"{n}: {why}" for n, why in left.items())
        raise UsageError(f"no strategy planned runs with {where} ({reasons})")
    return kept, left


def recommend_count(best: list[Prediction], workers: int, one_setting: bool = False) -> str:
    """The replica count to use, in one sentence: `best` holds each R's fastest strategy (or,
    `one_setting`, one setting at each R: --tune's, whose knobs the replica count was searched with)."""
    first = rank(best)[0]
    flat = next((p for p in best if p.replicas == workers), None)
    grouped = [p for p in best if p.replicas != workers]
    other = flat if first is not flat else (rank(grouped)[0] if grouped else None)
    where = (f"--replicas {first.replicas} ({first.replicas} replicas of {workers // first.replicas} workers each)"
             if first.replicas != workers else f"the flat cluster (--replicas {workers}: one worker a replica)")
    figure = (f"{format_seconds(first.time_to_target_s)} to the target loss" if first.time_to_target_s is not None
              else f"{first.tokens_per_s:,.0f} tokens/s")
    if other is None:
        return f"replica size: {where}, {first.label} at {figure}."
    if one_setting:
        whose = "the same setting " + ("on the flat cluster" if other is flat else f"with --replicas {other.replicas}")
    else:
        whose = "the flat cluster's best" if other is flat else "the best with replica groups"
        whose += f" ({named(other, workers)})"
    by = (f"{other.time_to_target_s / first.time_to_target_s:.2f}x faster to the target than {whose}"
          if first.time_to_target_s is not None and other.time_to_target_s is not None
          else f"{first.tokens_per_s / other.tokens_per_s:.2f}x the tokens/s of {whose}")
    return f"replica size: {where} is fastest, {first.label} at {figure}, {by}."

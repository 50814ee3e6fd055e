"""summary.json's `levels`: bytes and exposed time across replicas and inside a replica.

A flat run has one level, "cross" (every worker is a replica of one process); a run with
--replicas R < W has "intra" (inside each replica of K = W/R ranks, --intra-link) and
"cross" (the K groups of R ranks at the same position of every replica, --link). Each
level's bytes are set beside its plan (engines/inside.py's run_level_plans: the strategy's own
plan on R ranks across, one per position of a replica, the inside engine's on K ranks inside).
Every rank's counters are gathered where the run ends (train/run_end.py): this module only
puts numbers in their places.
"""
from __future__ import annotations

import torch

LEVELS = ("intra", "cross")
# A level in words a user reads (progress line, summary, report), the slow link's first.
LEVEL_WORDS = {"cross": "across replicas", "intra": "inside replicas"}


def planned_bytes(plans, ranks_in_group: int, groups: int, occurrences) -> int:
    """Wire bytes all ranks send for `plans` (one plan per position, or one for all) on
    `groups` groups of `ranks_in_group` ranks each."""
    total = sum(op.wire_bytes(ranks_in_group) * occurrences(op) for plan in plans for op in plan)
    return total * ranks_in_group * groups // len(plans)


def level_summary(every: torch.Tensor, strategy, plans, world: int, replicas: int, steps: int, links: dict) -> dict:
    """summary.json's `levels` from every rank's (W, levels, 3) wire bytes, exposed and busy seconds
    per level, with each level's planned bytes (`plans`: a LevelPlans)."""
    cls, size = type(strategy), world // replicas
    counts = {"intra": ([plans.intra], size, replicas, lambda op: cls.cost.intra_occurrences(op, steps, strategy.options)),
              "cross": (plans.cross, replicas, size, lambda op: cls.cost.plan_occurrences(op, steps, strategy.options))}
    out = {}
    for i, level in enumerate(LEVELS):
        plan, ranks, groups, occurrences = counts[level]
        out[level] = {
            "ranks_per_group": ranks, "groups": groups,
            "wire_bytes": int(every[:, i, 0].sum()),
            "planned_wire_bytes": planned_bytes(plan, ranks, groups, occurrences),
            "exposed_comm_s_per_rank": every[:, i, 1].tolist(),
            "comm_s_per_rank": every[:, i, 2].tolist(),
            "link": links.get(level),
        }
    return out


def has_levels(summary: dict) -> bool:
    """Whether a summary.json is of a run with replica groups (a flat run's `levels` hold one)."""
    return bool(summary.get("levels")) and summary.get("replicas", summary["workers"]) < summary["workers"]


def level_figures(summary: dict) -> dict[str, tuple[float, float]]:
    """level -> (bytes per token: all ranks' bytes on the level over the tokens trained; seconds
    a rank waited on it, mean over ranks), from a summary.json that has_levels, slow link first."""
    out = {}
    for level in LEVEL_WORDS:
        counted = summary["levels"][level]
        waits = counted["exposed_comm_s_per_rank"]
        out[level] = (counted["wire_bytes"] / max(summary["tokens"], 1), sum(waits) / len(waits))
    return out

"""A control group beside a run's process group, for the driver's agreements.

A strategy may have collectives in flight on its communication thread (ACCO's rounds)
when the run ends; an agreement issued on the same group from the compute thread would
pair with one of them on another rank (gloo aborts the process on the mismatch). So the
driver agrees on a second gloo group over the same ranks, created once per group,
collectively: every rank builds its first run on a group at the same point of its program.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

# Held weakly: torch holds a control group until destroy_process_group(), which must then
# free it (and join its gloo threads), not find it kept alive here (run/teardown.py).
_GROUPS: weakref.WeakValueDictionary[int, dist.ProcessGroup] = weakref.WeakValueDictionary()


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The gloo group beside `group` (None: the default group), created on first use."""
    base = group if group is not None else dist.group.WORLD
    key = id(base)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks=dist.get_process_group_ranks(base), backend="gloo")
    return _GROUPS[key]


def register_control(group: dist.ProcessGroup, control: dist.ProcessGroup) -> None:
    """`control` is the control group beside `group` (groups formed on every rank at once, comm/groups.py)."""
    _GROUPS[id(group)] = control


def control_groups() -> list[dist.ProcessGroup]:
    """Every control group made so far (a caller shortening their timeouts)."""
    return list(_GROUPS.values())


def forget_control_groups() -> None:
    """Drop every control group (their process group is being destroyed: a new one gets its own)."""
    _GROUPS.clear()


def agree_max(value: int, group: dist.ProcessGroup | None) -> int:
    """The largest `value` over the ranks of `group`, through its control group."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control_group(group))
    return int(t)

"""`lowcomm.wrap()`: your loop, our strategy.

    run = lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=3e-4), strategy="acco", accum=4,
                       link="100mbit,10ms")
    for batch in loader:                      # your loop, data and loss
        loss = loss_fn(run.model, batch)
        run.backward(loss)                    # accumulate / communicate / step, as the strategy decides
        if run.stepped:
            log(run.result)                   # StepResult of the optimizer step that just finished
    with run.evaluating() as m:               # the parameters to evaluate (ACCO: θ, not the estimate)
        evaluate(m)
    run.close()                               # or `with lowcomm.wrap(...) as run:`

The strategy is told "a backward just finished" and decides whether to keep
accumulating, start or finish a communication round, swap parameters, or
step: the same driver (run.py) the CLI's trainer runs `step()` on. The
process group is the one you made, torchrun's (initialised here from its
environment when you have not), or none for a single process.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from .comm import Comm
from .comm.link import LinkModel, split_link_spec
from .errors import UsageError
from .run import RunDriver, link_seed, make_pacer, make_run
from .strategies.base import MakeOptimizer
from .strategies.context import Schedule
from .values import parse_slowdown, parse_stragglers


def wrap(model: torch.nn.Module, make_optimizer: MakeOptimizer, strategy: str = "ddp", *, accum: int = 1,
         schedule: Schedule | None = None, total_steps: int | None = None,
         link: str | LinkModel | None = None, slowdown: float | Sequence[float] | None = None,
         stragglers: str | tuple[float, float] | None = None, seed: int = 0,
         group: dist.ProcessGroup | None = None, **options) -> RunDriver:
    """Put `model` under `strategy` for a loop of your own.

    make_optimizer(params) builds the inner optimizer; accum is micro-batches per
    optimizer step (acco: at least, per round); schedule(step) -> lr; total_steps
    the run's length where a strategy needs it (DiLoCo's last sync); `options` are
    the strategy's own (the CLI's names and defaults, e.g. max_accum=8).
    Emulation: link "BW,LAT[,JIT]" (e.g. "100mbit,10ms") or a LinkModel; slowdown
    this rank's factor, or one per rank; stragglers "P,F".
    """
    _join_group_if_torchrun(model)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    comm = Comm(group, link=_link(link, link_seed(seed, rank)))
    factor = _slowdown(slowdown, rank, world)
    straggle = parse_stragglers(stragglers, "stragglers") if stragglers is not None else None
    return make_run(strategy, model, comm, make_optimizer, accum=accum, schedule=schedule, total_steps=total_steps,
                    pacer=make_pacer(rank, world, factor, straggle, seed), **options)


def _join_group_if_torchrun(model: torch.nn.Module) -> None:
    """Inside torchrun with no group yet, make one from its environment (NCCL for a CUDA model)."""
    if dist.is_initialized() or not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return
    cuda = any(p.is_cuda for p in model.parameters())
    dist.init_process_group("nccl" if cuda and dist.is_nccl_available() else "gloo")


def _link(link, seed: int) -> LinkModel | None:
    if link is None or isinstance(link, LinkModel):
        return link
    bandwidth, latency, jitter = split_link_spec(link, "link")
    return LinkModel.parse(bandwidth, latency, jitter, seed=seed)


def _slowdown(slowdown, rank: int, world: int) -> float:
    if slowdown is None:
        return 1.0
    if isinstance(slowdown, (int, float)):
        return parse_slowdown([slowdown])[0]
    factors = parse_slowdown(slowdown)
    if len(factors) != world:
        raise UsageError(f"slowdown has {len(factors)} factor(s) but there are {world} workers (give one per worker)")
    return factors[rank]

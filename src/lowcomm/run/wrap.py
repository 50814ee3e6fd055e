"""`lowcomm.wrap()`: your loop, our strategy.

    run = lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=3e-4), strategy="acco", accum=4,
                       link="100mbit,10ms")
    for batch in loader:                      # your loop, data and loss
        with run.autocast():                  # the run's precision= (fp32: nothing; bf16, fp16: autocast)
            loss = loss_fn(run.model, batch)
        run.backward(loss)                    # accumulate / communicate / step, as the strategy decides
        if run.stepped:
            log(run.result)                   # StepResult of the optimizer step that just finished
    with run.evaluating() as m:               # the parameters to evaluate (ACCO: θ, not the estimate)
        evaluate(m)
    run.close()                               # or `with lowcomm.wrap(...) as run:`

The strategy is told "a backward just finished" and decides whether to keep
accumulating, start or finish a communication round, swap parameters, or
step: the same driver (run/driver.py) the CLI's trainer runs `step()` on. The
process group is the one you made, torchrun's (initialised here from its
environment when you have not), or none for a single process.

Replica groups (HSDP's layout, as `lowcomm train --replicas`): `replicas=R` runs the
world's W processes as R replicas of K = W/R, ranks r·K .. r·K+K−1 forming replica r
(under torchrun with K processes a node: replica r is node r). `inside` ("ddp") runs
inside each replica over `intra_link`, the strategy across replicas over `link`:

    run = lowcomm.wrap(model, make_opt, "zero1", replicas=2, intra_link="10gbit,50us", link="1gbit,5ms")
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank())

Shard the data by global rank as for any data-parallel run (torchtitan's dp_rank): a
replica's K ranks then read K different micro-batches, and R replicas of K at micro-batch
m train as R workers at micro-batch K·m would. A loader sharded per replica takes
`run.replica_rank` / `run.replicas` (which replica, how many) and `run.rank_in_replica` /
`run.replica_size` (the position in it, K): torchft's DistributedSampler(data,
replica_rank=run.replica_rank, num_replica_groups=run.replicas,
group_rank=run.rank_in_replica, num_replicas=run.replica_size).
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm.control import control_group
from ..comm.groups import ReplicaLayout
from ..comm.link import LinkModel, split_link_spec
from ..errors import UsageError
from ..robust import check_own_loop
from .build import build, link_seed, make_pacer, replica_groups, world_comm
from .driver import RunDriver
from .teardown import destroy_at_exit
from ..engines.inside import check_layout
from ..contract.options import RunShape, build_options
from ..strategies.registry import available, get, resolve
from ..contract.base import MakeOptimizer
from ..contract.context import Schedule
from ..contract.values import parse_slowdown, parse_stragglers


def wrap(model: torch.nn.Module, make_optimizer: MakeOptimizer, strategy: str = "ddp", *, accum: int = 1,
         schedule: Schedule | None = None, total_steps: int | None = None,
         link: str | LinkModel | None = None, slowdown: float | Sequence[float] | None = None,
         stragglers: str | tuple[float, float] | None = None, seed: int = 0,
         group: dist.ProcessGroup | None = None, replicas: int | None = None, inside: str = "ddp",
         intra_link: str | LinkModel | None = None, precision: str = "fp32", **options) -> RunDriver:
    """Put `model` under `strategy` for a loop of your own.

    make_optimizer(params) builds the inner optimizer; accum is micro-batches per
    optimizer step (acco: at least, per round); schedule(step) -> lr; total_steps
    the run's length where a strategy needs it (DiLoCo's last sync); `options` are
    the strategy's own (the CLI's names and defaults, e.g. max_accum=8).
    Emulation: link "BW,LAT[,JIT]" (e.g. "100mbit,10ms") or a LinkModel; slowdown
    this rank's factor, or one per rank; stragglers "P,F".
    Replica groups: replicas R (None or the world size: one per process, flat), inside
    the engine in each replica ("ddp"), intra_link its link ("BW,LAT[,JIT]" or a LinkModel),
    formed from the default process group (see the module docstring for the data sharding).
    Precision: "fp32", "bf16" or "fp16" (CUDA): run your forward in `with run.autocast():`;
    backward() scales fp16's loss and every gradient arrives unscaled (run/precision.py).
    """
    check_own_loop(options.get("attack", "none"))  # this loop's data is the user's: no data attack reaches it
    _join_group_if_torchrun(model)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    cross_link = _link(link, link_seed(seed, rank))
    factor = _slowdown(slowdown, rank, world)
    straggle = parse_stragglers(stragglers, "stragglers") if stragglers is not None else None
    run = dict(accum=accum, schedule=schedule, total_steps=total_steps, precision=precision,
               pacer=make_pacer(rank, world, factor, straggle, seed))

    def cross(_seed: int) -> LinkModel | None:  # made above with this rank's seed: a bad spec is refused first
        return cross_link

    if not replicas and intra_link is None and inside == "ddp":  # flat, as always: the strategy on the group
        driver = build(strategy, model, make_optimizer,
                       world_comm(ReplicaLayout(world, world), rank, seed, cross, group), None, **run, **options)
        levels = None
    else:
        strategy, opts = _replica_options(strategy, options, world, replicas or world, inside, accum, intra_link, group)
        layout = ReplicaLayout(world, replicas or world)
        # the groups and links as the CLI's workers make them (run/build.py)
        levels = replica_groups(layout, rank, seed, cross, lambda s: _link(intra_link, s))
        driver = build(strategy, model, make_optimizer, None if levels else world_comm(layout, rank, seed, cross, group),
                       levels, **run, options=opts, inside=inside)
    if levels is not None and inside != "fsdp":  # formed for this run alone: close() destroys them
        # (not under FSDP, whose sharded model keeps using them: destroy_process_group() ends them)
        driver.destroys([levels.intra.group, levels.cross.group, control_group(levels.cross.group)])
    return driver


def _replica_options(strategy: str, values: dict, world: int, replicas: int, inside: str, accum: int,
                     intra_link, group) -> tuple[str, object]:
    """The strategy (under the name that runs) and its options, once replicas, inside and the
    strategy are checked to fit together as the CLI checks them; a UsageError in one line."""
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise UsageError(f"replicas must be a whole number of replicas, got {replicas!r}")
    if replicas < world and group is not None and group is not dist.group.WORLD:
        raise UsageError("replicas= forms its groups from the default process group: pass group= or replicas=, "
                         "not both")
    name, opts = resolve(strategy, build_options(get(strategy).Options, values, strategy))
    supported = [n for n in available() if get(n).runs_inside(inside)]
    check_layout(world, replicas, inside, name, supported, intra_link=intra_link is not None, spell=_keyword)
    # the strategy's own rules about replicas (e.g. diloco's sync_by="time"), as on the CLI
    opts.check_run(RunShape(strategy=name, workers=world, replicas=replicas, accum=accum, inside=inside))
    return name, opts


def _keyword(name: str, value=None) -> str:
    """A setting as wrap()'s caller wrote it (`replicas=3`); the workers are the world's processes."""
    if name == "workers":
        return "the world size" if value is None else f"the world size {value}"
    return name if value is None else f"{name}={value!r}"


def _join_group_if_torchrun(model: torch.nn.Module) -> None:
    """Inside torchrun with no group yet, make one from its environment (NCCL for a CUDA model),
    destroyed at the script's end unless the script destroys it (run/teardown.py)."""
    if dist.is_initialized() or not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return
    cuda = any(p.is_cuda for p in model.parameters())
    dist.init_process_group("nccl" if cuda and dist.is_nccl_available() else "gloo")
    destroy_at_exit(dist.group.WORLD)


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

"""FSDP inside a replica (--inside fsdp): parameters, gradients and optimizer state sharded over
the replica's K ranks by torch's FSDP2 (`fully_shard`), so a process holds about 1/K of them.

    fully_shard each transformer block, then the whole model (the rest: embeddings, final
        norm), on a 1-D DeviceMesh of the replica's group
    forward    each unit's parameters all-gathered before it runs and freed after it (the
               root's kept for the backward: FSDP would gather them again at once)
    backward   each block's parameters all-gathered again; every unit's gradients reduce-
               scattered (mean over the replica) into this rank's shard, every micro-batch
    the strategy then runs across replicas on this rank's shards (`part`: plain tensors that
    alias FSDP's shards, so what the strategy writes there is what the next all-gather sends)

FSDP's collectives run through the replica's Comm (FSDPModule.set_custom_all_gather /
set_custom_reduce_scatter), so they are counted and pay the --intra-link emulation like every
other level's traffic, and `fsdp_level_plans` says what they send. An evaluation's all-gathers
(the model in eval mode) are bookkeeping, as the ddp engine's sharing around an evaluation is.
They run synchronously: on CPU (gloo) nothing would overlap them anyway; on GPU this gives up
FSDP's prefetch overlap, not correctness.

A shard is torch.chunk's piece of dim 0 (FSDP2's Shard(0)): of a tensor of d rows, rank r
holds rows [r·c, (r+1)·c) with c = ceil(d/K) (the last ranks fewer, possibly none); the
collectives carry every shard padded to c rows.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..comm import Comm
from ..errors import RunError, UsageError
from ..models.layout import OUTSIDE, ModelLayout, block_list, layout_of, trainable
from .flat import groups_by_index, rebuilt
from ..contract.plan import LevelPlans, PlannedOp

_OPS = {dist.ReduceOp.AVG: "avg", dist.ReduceOp.SUM: "sum"}  # what FSDP asks for fp32 gradients


class _Buffers:
    """FSDP's communication buffers: plain allocations (FSDP's default)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class CountedAllGather(_Buffers, AllGather):
    """FSDP's all-gather of a unit's shards through the engine's Comm: counted in training,
    bookkeeping (not the run's traffic, no emulated link) while `model` is in eval mode."""

    def __init__(self, engine: "InsideFSDP", model: nn.Module):
        self.engine, self.model = engine, model

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if self.model.training:
            with self.engine.waiting():
                self.engine.comm.all_gather(output_tensor, input_tensor)
        else:
            output_tensor.copy_(self.engine.comm.meta_all_gather(input_tensor).reshape(-1))
        return None  # done: FSDP waits only on a Work it is handed


class CountedReduceScatter(_Buffers, ReduceScatter):
    """FSDP's reduce-scatter of a unit's gradients through the engine's Comm."""

    def __init__(self, engine: "InsideFSDP"):
        self.engine = engine

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in _OPS:  # FSDP picks pre/post-scaled sums only for fp16 or a divide factor we never set
            raise RunError(f"--inside fsdp: FSDP asked for reduce-scatter op {op}, which lowcomm does not route")
        with self.engine.waiting():
            self.engine.comm.reduce_scatter(output_tensor, input_tensor, op=_OPS[op])
        return None


class InsideFSDP:
    """FSDP2 inside a replica: this rank holds its shard of every tensor (see the module docstring)."""

    name = "fsdp"
    # fully_shard turns the model into FSDP's, bound to this replica's mesh: a run on another
    # group (an elastic membership) needs a model of its own.
    reshapes_model = True

    def __init__(self, comm: Comm):
        self.comm = comm
        self.units: list[nn.Module] = []
        self.sharded: list[nn.Parameter] = []  # FSDP's parameters (DTensors), in model order
        self.local: list[torch.Tensor] = []    # this rank's shard of each: what the strategy runs on
        self._waited = 0.0                     # seconds in collectives inside the forward/backward

    def strategy_class(self, cls: type) -> type:
        """The form a strategy takes with FSDP inside: its `fsdp_form()` where it declares one
        (ddp's is HSDP, strategies/hsdp.py); the rest run as they are."""
        form = getattr(cls, "fsdp_form", None)
        return form() if form is not None else cls

    def part(self, model: nn.Module) -> tuple[list[torch.Tensor], ModelLayout]:
        """Shard `model` in place (every rank already holds the same values); this rank's shards
        of its trainable tensors and their layout."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        scalars = [name for name, p in model.named_parameters() if p.requires_grad and p.dim() == 0]
        if scalars:  # FSDP2 shards dim 0 and refuses a tensor without one (a raw ValueError)
            raise UsageError(f"--inside fsdp cannot shard the 0-d parameter '{scalars[0]}' (FSDP2 shards dim 0): "
                             "give it shape (1,) or use --inside ddp")
        self._originals = trainable(model)  # the user's parameters, until the optimizer's groups are read
        self._owners = [(module, name, p) for module in model.modules()
                        for name, p in module.named_parameters(recurse=False)]
        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(self.comm.group, device.type)
        self.units = [*(block_list(model) or []), model]  # the root last: it takes what the blocks left
        for unit in self.units:
            fully_shard(unit, mesh=mesh)
        for unit in self.units:
            unit.set_custom_all_gather(CountedAllGather(self, model))
            unit.set_custom_reduce_scatter(CountedReduceScatter(self))
        self.sharded = trainable(model)
        with torch.no_grad():  # the local tensor itself (a leaf, FSDP's storage), not an autograd view
            self.local = [p.to_local() for p in self.sharded]
        model.register_state_dict_post_hook(_local_state)
        model.register_load_state_dict_pre_hook(_sharded_state)
        return self.local, shard_layout(layout_of(model), self.comm.world, self.comm.rank)

    def optimizer_factory(self, make_optimizer):
        """make_optimizer as the strategy calls it, on this rank's shards, with the param groups
        the user's make_optimizer gives the model's own parameters. FSDP replaced those, so
        groups chosen by name or identity would all miss the shards: the user's function is
        called once on the originals, while the model shows them again (a function that reads
        model.named_parameters() when called, as nanoGPT's configure_optimizers does, would
        otherwise get FSDP's DTensors), and each group rebuilt on their shards (flat.rebuilt)."""
        read = []  # (the reference optimizer, its groups by index), once

        def make(params):
            params = list(params)
            if len(params) != len(self.local) or any(p is not q for p, q in zip(params, self.local)):
                return make_optimizer(params)  # not the shards: nothing to map
            if not read:
                with _showing(self._owners):
                    reference = make_optimizer(self._originals)
                read.append((reference, groups_by_index(reference, self._originals)))
                self._originals = self._owners = []  # the full tensors are FSDP's shards now: let them go
            return rebuilt(*read[0], self.local, make_optimizer)
        return make

    @torch.no_grad()
    def reduce_to_owners(self, params, op: str = "avg") -> None:
        """Each shard's gradient <- the replica's mean ("avg") or sum of it: FSDP reduce-scattered
        it (mean) in the backward; moved off FSDP's parameter so the next step starts from none."""
        for p, local in zip(self.sharded, self.local, strict=True):
            local.grad = p.grad.to_local() if p.grad is not None else torch.zeros_like(local)
            p.grad = None
            if op == "sum":
                local.grad.mul_(self.comm.world)

    def share(self, params, counted: bool = True) -> None:
        """Nothing to share: FSDP gathers the parameters where they are used. Around an evaluation
        (the driver's uncounted share) the root's gathered parameters, which FSDP keeps after a
        forward for the backward that follows in training, are freed: the next step gathers the
        shards as they are then, as the plan counts."""
        if not counted:
            for unit in self.units:
                unit.reshard()

    @contextmanager
    def waiting(self):
        """Time a collective FSDP runs inside the forward or backward (see take_waited)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._waited += time.perf_counter() - t0

    def take_waited(self) -> float:
        """Seconds this rank waited on FSDP's collectives since the last call: they run inside the
        micro-batch the driver times as compute, and Comm counts them as exposed already."""
        waited, self._waited = self._waited, 0.0
        return waited


@contextmanager
def _showing(owners: list[tuple[nn.Module, str, nn.Parameter]]):
    """Each (module, name, parameter) of `owners` registered on its module again, and what the
    module holds now (FSDP's DTensor) put back after."""
    now = [(module, name, module._parameters[name]) for module, name, _ in owners]
    for module, name, p in owners:
        module.register_parameter(name, p)
    try:
        yield
    finally:
        for module, name, p in now:
            module.register_parameter(name, p)


def shard_rows(rows: int, K: int, rank: int) -> int:
    """Rows of a `rows`-row tensor that rank `rank` of K holds (torch.chunk's pieces)."""
    c = -(-rows // K)
    return max(0, min(rows, (rank + 1) * c) - rank * c)


def shard_layout(layout: ModelLayout, K: int, rank: int) -> ModelLayout:
    """The layout of rank `rank`'s shards (blocks kept: Streaming DiLoCo's fragments stay whole blocks)."""
    return ModelLayout(tuple((shard_rows(s[0], K, rank), *s[1:]) for s in layout.shapes), layout.blocks)


def fsdp_units(layout: ModelLayout) -> tuple[list[list[int]], list[int]]:
    """Tensor indices of each block's unit, and of the root's (everything outside blocks)."""
    blocks = layout.blocks or (OUTSIDE,) * len(layout.shapes)
    ids = sorted({b for b in blocks if b != OUTSIDE})
    return ([[j for j, b in enumerate(blocks) if b == i] for i in ids],
            [j for j, b in enumerate(blocks) if b == OUTSIDE])


def fsdp_level_plans(cls, layout: ModelLayout, replicas: int, K: int, options, accum: int) -> LevelPlans:
    """What one rank sends with FSDP inside replicas of K ranks (fp32, `accum` micro-batches a
    step). Inside, per micro-batch: every unit's padded shards all-gathered in the forward, the
    blocks' again in the backward (the root's stay gathered in between), every unit's gradients
    reduce-scattered. Across: position p runs the strategy's own plan on its shards."""
    def padded(indices):  # a unit's collective: each tensor's shards padded to ceil(d/K) rows
        return sum(4 * K * -(-layout.shapes[j][0] // K) * (layout.numels[j] // max(layout.shapes[j][0], 1))
                   for j in indices)
    blocks, root = fsdp_units(layout)
    every_unit = sum(padded(u) for u in [*blocks, root])
    intra = [PlannedOp("all_gather", accum * every_unit, what="parameters for the forward, unit by unit (fp32)"),
             PlannedOp("all_gather", accum * sum(padded(u) for u in blocks),
                       what="the blocks' parameters again for the backward (fp32)"),
             PlannedOp("reduce_scatter", accum * every_unit, what="gradients to their shards, unit by unit (fp32)")]
    intra = [op for op in intra if op.nbytes]
    return LevelPlans(intra, [cls.comm_plan(shard_layout(layout, K, p), replicas, options) for p in range(K)])


def _local_state(module, state_dict, prefix, local_metadata) -> None:
    """A checkpoint holds each rank's own shards as plain tensors (per-rank state, no DTensor
    global metadata for DCP to reconcile across the `rank<r>` namespaces)."""
    from torch.distributed.tensor import DTensor
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[key] = value.to_local()


def _sharded_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    """Loading: this rank's saved shards back as DTensors shaped like FSDP's parameters."""
    from torch.distributed.tensor import DTensor
    targets = dict(module.named_parameters(prefix=prefix, remove_duplicate=False))
    for key, value in state_dict.items():
        target = targets.get(key)
        if isinstance(target, DTensor) and not isinstance(value, DTensor):
            state_dict[key] = DTensor.from_local(value.to(target.device), target.device_mesh, target.placements,
                                                 run_check=False, shape=target.shape, stride=target.stride())

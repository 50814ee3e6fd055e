"""ZeRO-1's building blocks, shared by zero1, acco and dpu (not a strategy itself).

FlatModel: all trainable parameters (and their gradients) become views into
one contiguous buffer each, padded to a multiple of W, so a reduce-scatter
hands rank r exactly its shard and an all-gather refills every parameter at
once. With FSDP inside a replica (--inside fsdp) the parameters are FSDP's shards, whose storage
FSDP gathers from: the buffers then hold copies of them instead (the replica's gradients added in
where they are reduced, the parameters written back where they are shared).

ShardOptimizer: the inner optimizer over this rank's shard only, holding an
fp32 master copy of it (an alias of the parameter shard when parameters are
already fp32, so no memory is spent twice). Optimizer state therefore costs
1/W of DDP's.

Parameter groups (e.g. no weight decay on biases and norms): the flat buffer is laid
out group by group, so each group's part of a shard is one contiguous piece, and the
shard's optimizer has one param group per piece with that group's hyperparameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import UsageError
from ..contract.base import Strategy
from ..contract.context import StepContext, schedule_like
from ..contract.options import Options, option
from ..contract.plan import flat_numel
from ..contract.replica import part_is_engines
from . import flat_reshard

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: the model's own dtype


def flat_bytes(num_params: int, world: int, options) -> int:
    """S of one full flat buffer (padded to a multiple of W) in parameter precision."""
    itemsize = torch.empty((), dtype=PARAM_DTYPES[options.param_dtype]).element_size()
    return flat_numel(num_params, world) * itemsize


def param_groups_of(reference: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[tuple[dict, list]]:
    """(hyperparameters, parameters in model order) of each param group of `reference`."""
    member = {id(p): g for g, group in enumerate(reference.param_groups) for p in group["params"]}
    return [({k: v for k, v in group.items() if k != "params"}, [p for p in params if member.get(id(p)) == g])
            for g, group in enumerate(reference.param_groups)]


def optimizer_of_groups(reference: torch.optim.Optimizer, groups: list[dict], one_group) -> torch.optim.Optimizer:
    """`reference`'s optimizer class over `groups` (each {hyperparameters, "params"}), with its
    defaults; `one_group()` builds it where the class cannot be built from groups alone."""
    try:
        optimizer = type(reference)(groups)
    except TypeError:  # an optimizer class that cannot be built from param groups alone
        if len(groups) > 1:
            raise UsageError(f"{type(reference).__name__} cannot be rebuilt from param groups for a "
                             f"sharded strategy; give it default arguments or use one param group") from None
        optimizer = one_group()
    optimizer.defaults = dict(reference.defaults)
    return optimizer


def groups_by_index(reference: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[tuple[dict, list[int]]]:
    """(hyperparameters, indices into `params`) of each param group of `reference`."""
    index = {id(p): i for i, p in enumerate(params)}
    return [(hyper, [index[id(p)] for p in members]) for hyper, members in param_groups_of(reference, params)]


def rebuilt(reference: torch.optim.Optimizer, groups: list[tuple[dict, list[int]]], tensors: list[torch.Tensor],
            make_optimizer) -> torch.optim.Optimizer:
    """`reference`'s groups (groups_by_index) over `tensors`, the i-th standing for the i-th
    parameter they were read from (e.g. its FSDP shard); every group kept, an empty one too."""
    return optimizer_of_groups(reference, [{**hyper, "params": [tensors[i] for i in idx]} for hyper, idx in groups],
                               lambda: make_optimizer(tensors))


class FlatModel:
    """`params` in the order they are laid out (group by group); `group_ends` ends each group's range.
    `aliased=False` (the parameters are storage an engine owns, FSDP's shards, which must not be
    re-pointed): the flat buffers hold copies, moved by `add_grads` and `write_params`/`read_params`."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], world: int, rank: int,
                 dtype: torch.dtype | None = None, group_ends: list[int] | None = None, aliased: bool = True):
        self.model = model
        self.params_list = params
        self.aliased = aliased
        first = self.params_list[0]
        dtype = dtype or first.dtype
        self.numel = sum(p.numel() for p in self.params_list)
        self.shard_size = -(-self.numel // world)  # ceil
        padded = self.shard_size * world
        self.params = torch.zeros(padded, dtype=dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        for (p, values), (_, grad) in zip(self._spans(self.params), self._spans(self.grads)):
            values.copy_(p.detach())
            if aliased:
                p.data, p.grad = values, grad
        self.own = slice(rank * self.shard_size, (rank + 1) * self.shard_size)
        self.group_ends = group_ends or [self.numel]

    def own_pieces(self) -> list[tuple[int, int, int]]:
        """(group, start, end) of each group's piece of the own shard, in shard coordinates."""
        pieces, begin = [], 0
        for g, end in enumerate(self.group_ends):
            a, b = max(begin, self.own.start), min(end, self.own.stop)
            if a < b:
                pieces.append((g, a - self.own.start, b - self.own.start))
            begin = end
        return pieces

    def zero_grad(self) -> None:
        self.grads.zero_()

    def _spans(self, buffer: torch.Tensor):
        """(parameter, its values in `buffer`, shaped like it), in layout order."""
        offset = 0
        for p in self.params_list:
            n = p.numel()
            yield p, buffer[offset:offset + n].view_as(p)
            offset += n

    @torch.no_grad()
    def add_grads(self) -> None:
        """Not aliased: G += each parameter's .grad (dropped then, so the next is new); a
        parameter without one adds nothing."""
        for p, g in self._spans(self.grads):
            if p.grad is not None:
                g.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def write_params(self) -> None:
        """Not aliased: each parameter <- its values in the flat buffer."""
        for p, values in self._spans(self.params):
            p.copy_(values)

    @torch.no_grad()
    def read_params(self) -> None:
        """Not aliased: the flat buffer <- each parameter's values (after a load into the model)."""
        for p, values in self._spans(self.params):
            values.copy_(p)

    def check_views(self) -> None:
        """Fail loudly if something replaced a .grad (e.g. model.zero_grad(set_to_none=True))."""
        if not self.aliased:  # the gradients are the engine's until add_grads
            return
        for p in self.params_list:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != self.grads.untyped_storage().data_ptr():
                raise UsageError("a parameter's .grad no longer views the flat gradient buffer: do not call "
                                 "model.zero_grad() or optimizer.zero_grad() on a sharded strategy's model "
                                 "(the strategy zeroes gradients itself)")


class ShardOptimizer:
    """The inner optimizer over this rank's shard. `separate_master=True` keeps
    the fp32 master apart from the model's parameters even when both are fp32:
    ACCO and DPU load other parameters (estimates, gathered results) into the
    model while the master must keep holding the real θ."""

    def __init__(self, flat: FlatModel, make_optimizer, reference: torch.optim.Optimizer,
                 separate_master: bool = False):
        self.flat = flat
        own = flat.params[flat.own]
        self.aliased = own.dtype == torch.float32 and not separate_master
        master = own if self.aliased else own.detach().float().clone()
        self.master = nn.Parameter(master, requires_grad=False)
        # One param group per group's piece of the shard, views of the master (same storage),
        # built by the run's optimizer class with each group's hyperparameters.
        self.pieces, groups = [], []
        whole = len(reference.param_groups) == 1  # the whole shard (padding too) is one piece
        for g, a, b in [(0, None, None)] if whole else flat.own_pieces():
            piece = self.master if whole else nn.Parameter(self.master.data[a:b], requires_grad=False)
            self.pieces.append((piece, slice(a, b)))
            hyper = {k: v for k, v in reference.param_groups[g].items() if k != "params"}
            groups.append({**hyper, "params": [piece]})
        self.optimizer = optimizer_of_groups(reference, groups, lambda: make_optimizer([self.master]))
        schedule_like(self.optimizer, reference)  # a shard holds only some groups: scale as the whole set

    def step(self, shard_grad: torch.Tensor) -> None:
        """One inner-optimizer step of the own shard from its (already averaged) gradient."""
        grad = shard_grad if shard_grad.dtype == torch.float32 else shard_grad.float()
        for piece, where in self.pieces:
            piece.grad = grad[where]
        self.optimizer.step()
        for piece, _ in self.pieces:
            piece.grad = None

    def own_params(self) -> torch.Tensor:
        """The own shard in parameter precision, ready to all-gather."""
        if self.aliased:
            return self.flat.params[self.flat.own]
        return self.master.detach().to(self.flat.params.dtype)

    # ACCO's estimate rounds must leave no trace: snapshot, step, restore.
    def _state_tensors(self) -> list[torch.Tensor]:
        return [self.master.data] + [v for st in self.optimizer.state.values()
                                     for v in st.values() if torch.is_tensor(v)]

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the master shard and every optimizer state tensor (just the
        master while the optimizer has not stepped and has no state yet)."""
        if not self.optimizer.state:
            return [self.master.detach().clone()]
        return [t.clone() for t in self._state_tensors()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        if len(snap) == 1:  # the optimizer had not stepped yet: its lazy state must go too
            self.optimizer.state.clear()
            self.master.data.copy_(snap[0])
            return
        for tensor, saved in zip(self._state_tensors(), snap, strict=True):
            tensor.copy_(saved)

    def state_bytes(self) -> int:
        """Optimizer state plus the master copy when it is not an alias of the parameters."""
        tensors = self._state_tensors()[1:]
        master = 0 if self.aliased else self.master.numel() * self.master.element_size()
        return master + sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ShardedOptions(Options):
    param_dtype: str = option("fp32", "flat parameter/gradient buffers: fp32 or bf16 (fp32 master either way)",
                              choices=tuple(PARAM_DTYPES))

    def check_run(self, cfg) -> None:
        if self.param_dtype != "fp32" and (cfg.replicas or cfg.workers) < cfg.workers:
            # the tensors a rank does not own stay in the model's dtype: one model, two dtypes
            raise UsageError(f"--param-dtype {self.param_dtype} does not run across replica groups "
                             f"(--replicas {cfg.replicas}); use fp32")


class ShardedStrategy(Strategy):
    """A strategy on ZeRO-1's layout (zero1, acco, dpu): flat θ and ∇θ, optimizer
    state and master copy for the own shard only. `separate_master` keeps the
    master apart from the model's parameters (see ShardOptimizer). Like DDP, it
    starts every rank from rank 0's parameters."""

    Options = ShardedOptions
    separate_master = False

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        # Read the run's param groups from an optimizer over the model (it never steps).
        reference = make_optimizer(self.params)
        groups = param_groups_of(reference, self.params)
        ordered = [p for _, ps in groups for p in ps]
        ordered += [p for p in self.params if all(p is not q for q in ordered)]  # in no group: never stepped
        ends = [sum(p.numel() for _, ps in groups[:g + 1] for p in ps) for g in range(len(groups))]
        self.flat = FlatModel(model, ordered, comm.world, comm.rank, PARAM_DTYPES[self.options.param_dtype], ends,
                              aliased=not part_is_engines(self))
        self.shard_opt = ShardOptimizer(self.flat, make_optimizer, reference, separate_master=self.separate_master)
        # model.zero_grad() would drop accumulated gradients (set_to_none=False) or cut
        # .grad loose from the flat buffer (True): refuse it with a clear error instead.
        model.zero_grad = self._refuse_zero_grad

    def _refuse_zero_grad(self, set_to_none: bool = True) -> None:
        raise UsageError(f"do not call zero_grad() on a model trained with '{self.name}': the strategy "
                         f"accumulates into a flat gradient buffer and zeroes it itself")

    def release(self) -> None:
        self.model.__dict__.pop("zero_grad", None)

    def optimizers(self):
        return [self.shard_opt.optimizer]

    def optimizer_state_bytes(self) -> int:
        return self.shard_opt.state_bytes()

    def loss_scale(self) -> float:
        return 1.0 / self.accum

    def after_backward(self, ctx: StepContext) -> bool:
        # A model.zero_grad() between micro-batches would detach .grad from the flat
        # buffer and silently drop gradients: say so at the backward that shows it.
        self.flat.check_views()
        return super().after_backward(ctx)

    def state_parts(self):
        """θ, the shard optimizer's state and the master copy, sharded (gathered whole at a commit
        and re-cut for each membership); the flat gradient buffer, this worker's own (flat_reshard.py)."""
        return flat_reshard.sharded_parts(self, super().state_parts()["model"])

    # With fsdp inside (part_is_engines) the flat buffers are copies of FSDP's shards: the
    # replica's gradients are added in where they are reduced, and the parameters written back
    # where they are shared (after every step, around an evaluation, after acco's estimate).
    def reduce_inside(self, op: str = "avg") -> None:
        super().reduce_inside(op)
        if not self.flat.aliased:
            self.flat.add_grads()

    def share_inside(self, counted: bool = True) -> None:
        if not self.flat.aliased:
            self.flat.write_params()
        super().share_inside(counted)

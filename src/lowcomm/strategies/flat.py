"""ZeRO-1's building blocks, shared by zero1, acco and dpu.

FlatModel: all trainable parameters (and their gradients) become views into
one contiguous buffer each, padded to a multiple of W, so a reduce-scatter
hands rank r exactly its shard and an all-gather refills every parameter at
once.

ShardOptimizer: the inner optimizer over this rank's shard only, holding an
fp32 master copy of it (an alias of the parameter shard when parameters are
already fp32, so no memory is spent twice). Optimizer state therefore costs
1/W of DDP's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .base import Strategy


class FlatModel:
    def __init__(self, model: nn.Module, world: int, rank: int, dtype: torch.dtype | None = None):
        self.model = model
        self.params_list = [p for p in model.parameters() if p.requires_grad]
        if not self.params_list:
            raise ValueError("the model has no trainable parameters")
        first = self.params_list[0]
        dtype = dtype or first.dtype
        self.numel = sum(p.numel() for p in self.params_list)
        self.shard_size = -(-self.numel // world)  # ceil
        padded = self.shard_size * world
        self.params = torch.zeros(padded, dtype=dtype, device=first.device)
        self.grads = torch.zeros_like(self.params)
        offset = 0
        for p in self.params_list:
            n = p.numel()
            self.params[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.params[offset:offset + n].view_as(p)
            p.grad = self.grads[offset:offset + n].view_as(p)
            offset += n
        self.own = slice(rank * self.shard_size, (rank + 1) * self.shard_size)

    def zero_grad(self) -> None:
        self.grads.zero_()

    def check_views(self) -> None:
        """Fail loudly if something replaced a .grad (e.g. model.zero_grad(set_to_none=True))."""
        for p in self.params_list:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != self.grads.untyped_storage().data_ptr():
                raise RuntimeError("a parameter's .grad no longer views the flat gradient buffer; "
                                   "do not call model.zero_grad() on a sharded strategy's model")


class ShardOptimizer:
    """The inner optimizer over this rank's shard. `separate_master=True` keeps
    the fp32 master apart from the model's parameters even when both are fp32:
    ACCO and DPU load other parameters (estimates, gathered results) into the
    model while the master must keep holding the real θ."""

    def __init__(self, flat: FlatModel, make_optimizer, separate_master: bool = False):
        self.flat = flat
        own = flat.params[flat.own]
        self.aliased = own.dtype == torch.float32 and not separate_master
        master = own if self.aliased else own.detach().float().clone()
        self.master = nn.Parameter(master, requires_grad=False)
        self.optimizer = make_optimizer([self.master])

    def step(self, shard_grad: torch.Tensor) -> None:
        """One inner-optimizer step of the own shard from its (already averaged) gradient."""
        self.master.grad = shard_grad if shard_grad.dtype == torch.float32 else shard_grad.float()
        self.optimizer.step()
        self.master.grad = None

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


class ShardedStrategy(Strategy):
    """A strategy on ZeRO-1's layout (zero1, acco, dpu): flat θ and ∇θ, optimizer
    state and master copy for the own shard only. `separate_master` keeps the
    master apart from the model's parameters (see ShardOptimizer)."""

    separate_master = False

    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, param_dtype=None):
        super().__init__(model, comm, make_optimizer, accum, schedule)
        self.flat = FlatModel(model, comm.world, comm.rank, dtype=param_dtype)
        self.shard_opt = ShardOptimizer(self.flat, make_optimizer, separate_master=self.separate_master)

    def optimizers(self):
        return [self.shard_opt.optimizer]

    def optimizer_state_bytes(self) -> int:
        return self.shard_opt.state_bytes()

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

import copy

import torch
import torch.nn as nn


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
    def __init__(self, flat: FlatModel, make_optimizer):
        self.flat = flat
        own = flat.params[flat.own]
        self.aliased = own.dtype == torch.float32
        master = own if self.aliased else own.float()
        self.master = nn.Parameter(master, requires_grad=False)
        self.optimizer = make_optimizer([self.master])

    def step(self, shard_grad: torch.Tensor) -> None:
        """One inner-optimizer step of the own shard from its (already averaged) gradient."""
        self.master.grad = shard_grad if shard_grad.dtype == torch.float32 else shard_grad.float()
        self.optimizer.step()
        self.master.grad = None
        if not self.aliased:
            self.flat.params[self.flat.own].copy_(self.master.detach())

    def own_params(self) -> torch.Tensor:
        """The own shard in parameter precision, ready to all-gather."""
        return self.flat.params[self.flat.own]

    # ACCO's estimate rounds must leave no trace: snapshot, step, restore.
    def snapshot(self) -> dict:
        return {"master": self.master.detach().clone(),
                "state": copy.deepcopy(self.optimizer.state_dict()["state"])}

    def restore(self, snap: dict) -> None:
        self.master.data.copy_(snap["master"])
        sd = self.optimizer.state_dict()
        sd["state"] = snap["state"]
        self.optimizer.load_state_dict(sd)
        if not self.aliased:
            self.flat.params[self.flat.own].copy_(self.master.detach())

    def extra_bytes(self) -> int:
        """Master copy bytes when it is not an alias of the parameters."""
        return 0 if self.aliased else self.master.numel() * self.master.element_size()

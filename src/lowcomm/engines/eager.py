"""Eager updates (Kale, Douillard, Donchev, arXiv 2502.12996) as the outer-sync engine keeps them.

With the outer step one period late (--outer-delay 1), worker m's outer step at the end of
period t uses, in place of the delayed mean Δ̄^(t−1) alone,

    Δ̃_m^(t) = Δ̄^(t−1) + (1/M)·(Δ_m^(t) − Δ_m^(t−1))
            = (1/M)·(Δ_m^(t) + Σ_{m'≠m} Δ_{m'}^(t−1))

its own fresh pseudo-gradient standing in for its share of the mean still in flight, the
stale share it stood in for a period ago taken back out: θ_m^(t) = OuterOpt(θ_m^(t−1), Δ̃_m^(t)),
with Δ_m^(t) taken against the worker's own θ_m^(t−1). The workers' outer parameters (and
outer momenta) then differ, by their latest shares.

The outer optimizer (SGD, momentum, Nesterov; no weight decay) is linear in its gradients,
so θ_m = θ_global + e_m exactly (up to rounding): θ_global takes the outer step on the
delayed means alone -- the same on every worker, the replicated state a checkpoint, an
evaluation and a joiner see -- and this worker's offset e_m takes, with an outer optimizer of
its own (same hyperparameters, its own momentum), the outer step on the swap of shares
s_m^(t) − s_m^(t−1), s_m^(t) = Δ_m^(t)/M. That offset, the share standing in and its momentum
are the worker's own; a run's final sync withdraws them (every worker ends on θ_global).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class StandIn:
    """One worker's eager offsets e_m, one a fragment, and the share standing in for each."""

    def __init__(self, globals_: list[nn.Parameter], make_outer: Callable[[list], torch.optim.Optimizer]):
        self.offsets = [nn.Parameter(torch.zeros_like(g), requires_grad=False) for g in globals_]
        self.applied = [torch.zeros_like(g) for g in globals_]  # s_m of the mean in flight
        self.outer = make_outer(self.offsets)

    def replace(self, i: int, share: torch.Tensor) -> None:
        """Fragment i's new share stands in for the mean just issued, in place of the one that
        stood in for the mean that has now landed: e_i ← OuterOpt(e_i, share − applied)."""
        offset = self.offsets[i]
        offset.grad = share - self.applied[i]
        self.outer.step()
        offset.grad = None
        self.applied[i] = share.clone()

    @torch.no_grad()
    def withdraw(self, i: int) -> None:
        """Every mean has landed (the run's final sync): fragment i holds no stand-in any more."""
        self.offsets[i].zero_()
        self.applied[i].zero_()
        self.outer.state.pop(self.offsets[i], None)

    def state_dict(self) -> dict:
        """The offsets and shares (the offsets' momentum is the optimizer's state)."""
        return {"offsets": [e.detach().clone() for e in self.offsets], "applied": [a.clone() for a in self.applied]}

    def load_state_dict(self, sd: dict) -> None:
        for e, saved in zip(self.offsets, sd["offsets"], strict=True):
            e.data.copy_(saved)
        self.applied = [a.clone() for a in sd["applied"]]

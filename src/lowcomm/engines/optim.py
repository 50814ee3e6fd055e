"""Inner optimizers the engines build on: the user's make_optimizer held to the tensors it is
given (covering), 1-bit Adam's frozen-variance Adam."""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn

from ..errors import UsageError


def covering(make_optimizer, model: nn.Module):
    """make_optimizer, saying in one line when its optimizer's param groups leave out trainable
    tensors it was given, which would get gradients and never move: refused when they leave out
    every one (groups chosen by names or ids that match nothing), a warning when only some
    (torch allows it: a tensor meant to stay put is better frozen, requires_grad=False)."""
    def make(params):
        params = list(params)
        optimizer = make_optimizer(params)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        missed = [i for i in trainable if id(params[i]) not in held]
        if missed:
            names = {id(p): name for name, p in model.named_parameters()}
            first = params[missed[0]]
            what = (f"make_optimizer's param groups leave out {len(missed)} of the {len(trainable)} trainable tensors "
                    f"it was given (the first: '{names.get(id(first), f'#{missed[0]} of shape {tuple(first.shape)}')}')")
            if len(missed) == len(trainable):
                raise UsageError(f"{what}: nothing would train; build the groups from the params it is given, or "
                                 "from model.named_parameters() read when it is called")
            warnings.warn(f"{what}: they will get gradients and never move; set requires_grad=False on them "
                          "to say so, or give them a group (lr 0 holds one still)", stacklevel=2)
        return optimizer
    return make


class FrozenAdam:
    """Adam's (or AdamW's) step with its second moment frozen: 1-bit Adam's compression stage
    (Tang et al., arXiv 2102.02888). torch's Adam cannot freeze v (β2 = 1 zeroes its bias
    correction), so this does the update with the optimizer's own hyperparameters and keeps
    m and t in the optimizer's state, where its state_dict (and so a checkpoint) finds them;
    v is never written after the freeze. Written here because torch has no such step.

        adam = FrozenAdam(optimizer, params)        # refuses anything but Adam/AdamW
        g = adam.gradient(p, grad)                  # + wd·θ where weight decay is coupled (Adam)
        m = torch.lerp(adam.state(p)["exp_avg"], g, 1 - adam.beta1(p))   # ... reduced by the caller
        adam.apply(p, m, adam.denominators()[i])    # the first denominators() call freezes v
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params):
        if not isinstance(optimizer, torch.optim.Adam):
            raise UsageError(f"freezing the second moment (1-bit Adam) needs torch.optim.Adam or AdamW, got "
                             f"{type(optimizer).__name__}: strategy quantized compresses gradients into any optimizer")
        self.optimizer = optimizer
        self.params = list(params)
        # Each parameter's group by index: optimizer.load_state_dict() replaces the group
        # dicts (a resumed run's schedule sets lr in the new ones), so they are looked up anew.
        self._group_of = {}
        for i, group in enumerate(optimizer.param_groups):
            if group.get("amsgrad") or group.get("maximize"):
                raise UsageError("1-bit Adam's frozen variance does not support amsgrad or maximize")
            for p in group["params"]:
                self._group_of[p] = i
        self.frozen_at: list[float] | None = None  # each tensor's step count when v froze
        self._denominators = None

    def group(self, p) -> dict:
        return self.optimizer.param_groups[self._group_of[p]]

    def state(self, p) -> dict:
        st = self.optimizer.state[p]
        if not st:  # never stepped (no gradient during the warm-up): Adam's initial state
            st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                      exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        return st

    def beta1(self, p) -> float:
        return self.group(p)["betas"][0]

    def gradient(self, p, g: torch.Tensor) -> torch.Tensor:
        """What Adam feeds its momentum: g, plus wd·θ when weight decay is coupled (Adam)."""
        group = self.group(p)
        if group["weight_decay"] and not group.get("decoupled_weight_decay", False):
            return g.add(p.detach(), alpha=group["weight_decay"])
        return g

    def freeze(self) -> None:
        if self.frozen_at is None:
            self.frozen_at = [float(self.state(p)["step"]) for p in self.params]

    def denominators(self) -> list[torch.Tensor]:
        """sqrt(v / (1 - β2^t0)) + eps per tensor, from the frozen v (computed once)."""
        self.freeze()
        if self._denominators is None:
            self._denominators = []
            for p, t0 in zip(self.params, self.frozen_at):
                group, v = self.group(p), self.state(p)["exp_avg_sq"]
                bias2 = 1 - group["betas"][1] ** t0 if t0 > 0 else 1.0
                self._denominators.append((v.sqrt() / math.sqrt(bias2)).add_(group["eps"]))
        return self._denominators

    @torch.no_grad()
    def apply(self, p, momentum: torch.Tensor, denominator: torch.Tensor) -> None:
        """m <- momentum, t <- t + 1, θ <- θ·(1 - lr·wd) - lr/(1 - β1^t) · m / denominator."""
        group, st = self.group(p), self.state(p)
        st["exp_avg"].copy_(momentum)
        st["step"] += 1
        lr = group["lr"]
        if group["weight_decay"] and group.get("decoupled_weight_decay", False):
            p.mul_(1 - lr * group["weight_decay"])
        p.addcdiv_(st["exp_avg"], denominator, value=-lr / (1 - group["betas"][0] ** float(st["step"])))

    def state_dict(self) -> dict:
        return {"frozen_at": self.frozen_at}

    def load_state_dict(self, sd: dict) -> None:
        self.frozen_at, self._denominators = sd["frozen_at"], None

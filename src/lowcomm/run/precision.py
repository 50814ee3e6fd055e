"""A run's compute precision (--precision, make_run's / wrap()'s `precision=`): the forward and
backward under torch.autocast, and fp16's dynamic loss scaler.

    fp32   no autocast
    bf16   torch.autocast(device, torch.bfloat16): CPU or CUDA
    fp16   torch.autocast("cuda", torch.float16) and a loss scaler: CUDA only

Autocast casts per op (a matmul's inputs to bf16/fp16; reductions, softmax and the loss stay
fp32), so the parameters stay fp32 (or what --param-dtype makes them), their gradients arrive
in the parameters' dtype and every strategy's optimizer state and communication are those of
an fp32-compute run: what each strategy sends is unchanged, byte for byte.

fp16's scaler (torch's GradScaler's schedule: scale 2**16, halved on an overflow, doubled after
2000 steps without one) multiplies each micro-batch's loss by the scale, and a hook on every
trainable parameter divides the gradient by it before autograd accumulates it into `.grad`.
So every strategy sees true-scale gradients from the start, whatever it does with them during
the backward (DDP's comm hooks, PowerSGD's error feedback) or after (compression with error
feedback, its own optimizer steps). An overflow leaves an inf or NaN in a gradient; the
non-finite protocol every strategy keeps (contract/context.py) skips that step on every rank
the reduction reaches, and the scale follows the step's `skipped`, so the ranks that skip
together halve together. (Local-SGD inner steps, which send nothing, are skipped by the rank
that overflowed alone, as a non-finite gradient always was: that rank's scale halves.) The
scale is part of the run's state (RunDriver.state_dict), so a resumed run continues with it.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from ..errors import UsageError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Dynamic loss scaling (torch.amp.GradScaler's schedule), with the unscale done per
    gradient as autograd produces it (see the module docstring)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth_factor, self.backoff_factor = float(init_scale), growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0   # applied steps since the scale last changed
        self.overflows = 0    # steps skipped so far (the scale halved at each)
        self._hooks: list = []

    def attach(self, params) -> None:
        """Unscale every gradient of `params` before it is accumulated into `.grad`."""
        self._hooks = [p.register_hook(self._unscale) for p in params if p.requires_grad]

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _unscale(self, grad: torch.Tensor) -> torch.Tensor:
        # a power of two: exact in fp32 (an inf or NaN stays one, for the non-finite protocol)
        return grad * (1.0 / self.scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def update(self, skipped: bool) -> None:
        """After a step: halve the scale when it was skipped, else double it every growth_interval steps."""
        if skipped:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.overflows += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])
        self.overflows = int(sd.get("overflows", 0))


class Precision:
    """What a run computes its forward and backward in: autocast's dtype on a device type, and
    (fp16) a loss scaler. Precision("fp32", scaler=LossScaler()) runs the scaler with fp32
    compute (what the tests check the scaler with on a CPU)."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu", scaler: LossScaler | None = None):
        if name not in DTYPES:
            raise UsageError(f"unknown precision '{name}' (choose from: {', '.join(DTYPES)})")
        self.name, self.device_type, self.scaler = name, device_type, scaler

    @property
    def dtype(self) -> torch.dtype | None:
        """autocast's dtype (None: fp32, no autocast)."""
        return DTYPES[self.name]

    def autocast(self):
        """The context to run a forward (and its loss) in."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def attach(self, params) -> None:
        """The scaler's hooks on the parameters the forward runs on (none without a scaler)."""
        if self.scaler is not None:
            self.scaler.attach(params)

    def detach(self) -> None:
        if self.scaler is not None:
            self.scaler.detach()

    def after_step(self, ctx) -> None:
        """A step ended (contract.context.StepContext): the scale follows its skip; an idle
        step (no micro-batch on this rank) leaves it."""
        if self.scaler is not None and not ctx.idle:
            self.scaler.update(ctx.skipped)

    def state_dict(self) -> dict:
        return {"name": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, sd: dict | None) -> None:
        """A saved scaler's state into this run's scaler (a state without one, or a run without
        one: nothing to restore)."""
        if sd and sd.get("scaler") and self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])


def make_precision(precision: "str | Precision", model: nn.Module, inside: str | None = None) -> Precision:
    """The run's Precision from a name (fp32, bf16, fp16) on `model`'s device, or as given;
    fp16 is refused off CUDA and with FSDP inside a replica, in one line."""
    if isinstance(precision, Precision):
        return precision
    first = next(model.parameters(), None)  # none at all: the strategy refuses the model, in its words
    device = first.device.type if first is not None else "cpu"
    if precision == "fp16":
        if device != "cuda":
            raise UsageError(f"precision fp16 needs CUDA (the model is on {device}): use bf16 on a CPU")
        if inside == "fsdp":
            raise UsageError("precision fp16 does not run with FSDP inside a replica (its loss scaler unscales "
                             "gradients as autograd accumulates them, which FSDP's sharded gradients bypass): "
                             "use bf16")
        return Precision("fp16", device, LossScaler())
    if precision == "bf16" and device not in ("cpu", "cuda"):
        raise UsageError(f"precision bf16 runs on a CPU or CUDA, not on {device}")
    return Precision(precision, device)


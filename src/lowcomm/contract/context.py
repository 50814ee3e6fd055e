"""What the run driver hands a strategy for the optimizer step in progress (`StepContext`),
and the small numeric helpers every strategy shares (non-finite checks, the lr schedule).

The non-finite protocol: a step whose loss or gradient is not finite on some rank is
skipped on every rank without an extra collective. The rank that sees it fills what it is
about to send with NaN (`ctx.poison_nonfinite`), the strategy's own reduction carries the
NaN to every rank, and each rank checks what it received (`ctx.received_finite`) before it
applies anything: all ranks hold the same reduced values, so they agree. The driver logs
skipped steps and the trainer stops after --max-bad-steps of them in a row.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..comm import CommStats

Schedule = Callable[[int], float]  # optimizer step (0-based) -> learning rate


@dataclass
class StepContext:
    """One optimizer step as the driver tallies it; strategies read and set the marked fields."""
    step: int                      # optimizer steps finished before this one (the schedule's index)
    t0: float                      # perf_counter() when the step began
    comm_before: CommStats         # Comm's counters then (the step's bytes and times are the difference)
    levels_before: dict[str, CommStats] = field(default_factory=dict)  # the same, per level (Comm.level)
    optimizer_before: float = 0.0  # the flight recorder's optimizer seconds then
    pull: bool = False             # driven by step() (pulls batches), not by a user's backward() calls
    lr: float = float("nan")       # strategy: the lr this step applies (reported)
    micro: int = 0                 # micro-batches of this step so far (a strategy may restart the count)
    micro_batches: int = 0         # micro-batches this rank computed in this step (the driver's count)
    loss_sum: float = 0.0
    tokens: int = 0
    compute_s: float = 0.0         # forward/backward time; a strategy moves measured waits out of it
    last_compute_s: float = 0.0    # the latest micro-batch's compute (DDP's exposed tail)
    last_compute_end: float = 0.0  # perf_counter() when it ended
    nonfinite_loss: bool = False   # a micro-batch of this step had a non-finite loss on this rank
    skipped: bool = False          # the step's update was not applied
    idle: bool = False             # strategy: this rank computes nothing in this step (an empty slot)
    idle_loss: float = float("nan")  # what an idle step reports as its loss

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.micro_batches, 1)

    def skip(self) -> None:
        """Mark this step's update as not applied (a strategy whose state saw the bad values
        clears that state itself)."""
        self.skipped = True

    def end_idle(self, loss: float) -> None:
        """Pull-style only: this rank has no micro-batch in this step; report `loss`."""
        self.idle, self.idle_loss = True, loss

    def poison_nonfinite(self, *local: torch.Tensor) -> bool:
        """Before sending: True (and `local` filled with NaN) when this rank's loss in this
        step, or a value of `local`, is not finite."""
        return fill_nan_if_nonfinite(*local, force=self.nonfinite_loss)

    def received_finite(self, *received: torch.Tensor) -> bool:
        """After the reduction, before the update: False (and the step skipped) when a
        received value is not finite; the caller then applies nothing."""
        if all_finite(*received):
            return True
        self.skip()
        return False


@dataclass
class StepResult:
    loss: float            # mean loss of this rank's micro-batches
    micro_batches: int     # micro-batches this rank computed
    tokens: int            # tokens this rank consumed
    wire_bytes: int        # ring-model bytes this rank sent
    compute_s: float       # forward/backward time
    comm_s: float          # time collectives were in flight (overlapped or not)
    exposed_comm_s: float  # time this rank waited on the network
    wall_s: float
    lr: float
    skipped: bool = False  # the step was not applied: a loss or gradient was not finite
    link_model_s: float = 0.0  # what the emulated link model prices this step's ops at (0: none)
    optimizer_s: float = 0.0   # optimizer.step() on the main thread (the flight recorder's spans; 0: none)
    # This step's traffic per level (Comm.level: "cross", and "intra" with replica groups);
    # the fields above are their sum.
    levels: dict[str, CommStats] = field(default_factory=dict)


def all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every value of every tensor is finite (one host sync for all of them). A tensor
    is finite exactly when its min and max are (NaN and inf reach both), and aminmax is about
    10x cheaper on CPU than an elementwise isfinite pass; integer tensors are always finite."""
    ends = [m.float() for t in tensors if t is not None and t.numel() and t.is_floating_point()
            for m in torch.aminmax(t)]
    return bool(torch.stack(ends).isfinite().all()) if ends else True


def fill_nan_if_nonfinite(*tensors: torch.Tensor, force: bool = False) -> bool:
    """Fill every tensor with NaN when one of them holds a non-finite value (or `force`); True then."""
    bad = force or not all_finite(*tensors)
    if bad:
        for t in tensors:
            t.fill_(float("nan"))
    return bad


def apply_schedule(optimizers: Iterable[torch.optim.Optimizer], schedule: Schedule | None, step: int) -> float:
    """Set every param group's lr for optimizer step `step`: schedule(step) is the lr of the
    group(s) with the largest initial lr, and every group keeps its initial ratio to it
    (torch's LambdaLR with the factor schedule(step) / that lr). One group, or groups at one
    lr, each get schedule(step) itself; no group ever steps above it. (The optimizer's
    top-level `lr=` plays no part: built from groups without one, it is torch's default.)
    Returns the run's lr at this step (the schedule's value, or the first group's lr)."""
    lr = float("nan")
    for optimizer in optimizers:
        if schedule is None or any("lr" not in g for g in optimizer.param_groups):
            lr = float(optimizer.param_groups[0]["lr"]) if math.isnan(lr) else lr
            continue
        lr = float(schedule(step))
        top = schedule_reference(optimizer)
        for group in optimizer.param_groups:
            initial = group.setdefault("initial_lr", group["lr"])
            group["lr"] = lr if initial == top or top == 0 else initial * lr / top
    return lr


# optimizer -> the initial lr its schedule's value stands for, where its groups are a part of
# the run's (a shard optimizer holding only some groups' pieces): taken from the whole set
_REFERENCE_LR: "weakref.WeakKeyDictionary[torch.optim.Optimizer, float]" = weakref.WeakKeyDictionary()


def schedule_like(optimizer: torch.optim.Optimizer, reference: torch.optim.Optimizer) -> None:
    """Schedule `optimizer` (built from some of `reference`'s param groups) as `reference`
    would be: the same largest initial lr on every rank, whichever groups this rank holds."""
    _REFERENCE_LR[optimizer] = schedule_reference(reference)


def schedule_reference(optimizer: torch.optim.Optimizer) -> float:
    """The initial lr that the schedule's value stands for: the largest of the groups'."""
    if optimizer in _REFERENCE_LR:
        return _REFERENCE_LR[optimizer]
    return max(float(g.get("initial_lr", g["lr"])) for g in optimizer.param_groups)


def flat_of(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors end to end as one vector (a copy)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def write_flat(flat: torch.Tensor, tensors: list[torch.Tensor | None], like: list[torch.Tensor] | None = None) -> None:
    """Copy the consecutive pieces of `flat` into `tensors`, in order (what flat_of undoes);
    `like` gives each piece's size where a target may be None (its piece is then skipped)."""
    at = 0
    for t, shape in zip(tensors, like if like is not None else tensors, strict=True):
        n = shape.numel()
        if t is not None:
            t.copy_(flat[at:at + n].view_as(t))
        at += n


def batch_tokens(batch: Any) -> int:
    """Tokens in a micro-batch: the input tensor's element count; for a dict batch
    the attention mask's ones (padding is not a token), else its input_ids."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        first = batch.get("input_ids", next((v for v in batch.values() if isinstance(v, torch.Tensor)), None))
    else:
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    return first.numel() if isinstance(first, torch.Tensor) else 0


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor (and bytes object) in a nested state (dicts, lists, tuples): what the
    state takes in memory, or in a checkpoint file."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return len(obj) if isinstance(obj, bytes) else 0

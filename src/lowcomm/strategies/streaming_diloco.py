"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): DiLoCo one fragment at a time, overlapped.

The parameters are split into F fragments. Fragment f syncs at the trainer
steps t with (t − ⌊f·H/F⌋) mod H = 0 (t ≥ 1), so its period is still H but
the F syncs are spread over it and one sync carries about 1/F of the model:
    Δ_f,r = θ_f,global − θ_f,r  (snapshot at t)
    async collectives, issued at t:  Δ_f = mean_r Δ_f,r
    meanwhile τ = --fragment-delay further inner steps run on the stale local θ
    at the end of trainer step t+τ: wait; θ_f,global ← outer SGD(θ_f,global, Δ_f)
        (per-fragment momentum);  θ_f,local ← α·θ_f,local + (1−α)·θ_f,global
τ=0 waits at once; F=1, τ=0, α=0 is DiLoCo exactly.

Fragments. lowcomm's GPT: strided over transformer blocks as in the paper,
block i in fragment i mod F; the embeddings (token, tied with the output
head, and position) and the final LayerNorm are in fragment 0. Any other
module: contiguous groups of parameters (in `parameters()` order) of nearly
equal size, a parameter never split. Fragments left empty (fewer blocks than
F) never sync.

The communication plan needs each fragment's size: `comm_plan(..., shapes=)`
(the parameters' shapes in `parameters()` order) recognises lowcomm's GPT by
its shape pattern and applies the same rule; without shapes it assumes an
even split of the count (exact in total, per fragment an estimate).

Everything else (outer optimizer, --outer-precision, --sync-by time, the
final sync of every fragment at the run's last step, evaluation of the
global θ) is DiLoCo's: see diloco.py. Under --sync-by time τ counts trainer
steps (slots), and the step-time exchange rides on each fragment's sync.
Why not overlap.py's Background engine: its job runs the collectives on a
communication thread, and a job still in flight when the trainer step ends
races the trainer's own between-step collectives (log gathers, evaluation) on
the same process group -- ranks then pair different collectives (gloo:
"Received data size doesn't match expected size"). Instead the fragment's
collectives are issued asynchronously (Comm's async_op) from the compute
thread, in the same order on every rank, and gloo progresses them on its own
threads while the τ inner steps run; only the wait at t+τ can be exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from ..errors import UsageError
from ..models.gpt import GPT
from .diloco import OuterOptions, OuterSync
from .options import option
from .registry import register

@dataclass
class StreamingOptions(OuterOptions):
    fragments: int = option(4, "model fragments F; fragment f syncs at steps f*H/F + k*H", min=1)
    fragment_delay: int = option(2, "inner steps (tau) that overlap a fragment's all-reduce before it merges",
                                 min=0)
    merge_alpha: float = option(0.5, "merge: theta_local <- alpha*theta_local + (1-alpha)*theta_global",
                                min=0, max=1)

    def check(self) -> None:
        super().check()
        if self.fragments > self.sync_every:
            raise UsageError(f"--fragments ({self.fragments}) must be at most --sync-every ({self.sync_every})")
        if self.fragment_delay >= self.sync_every:
            raise UsageError(f"--fragment-delay ({self.fragment_delay}) must be less than --sync-every "
                             f"({self.sync_every}): a fragment must land before its next sync")


def fragment_of_params(model: nn.Module, params: list, F: int) -> list[list]:
    """The fragments' parameters (see the module docstring)."""
    if isinstance(model, GPT):
        where = {}
        for b, block in enumerate(model.blocks):
            for p in block.parameters():
                where[id(p)] = b % F
        return [[p for p in params if where.get(id(p), 0) == f] for f in range(F)]
    return [[params[j] for j in group] for group in contiguous_groups([p.numel() for p in params], F)]


def contiguous_groups(numels: list[int], F: int) -> list[list[int]]:
    """Indices of consecutive tensors in F groups of nearly equal size (a tensor goes to the
    group its middle element falls in)."""
    total, before, out = sum(numels), 0, [[] for _ in range(F)]
    for j, n in enumerate(numels):
        out[min(F - 1, int((before + n / 2) * F // max(total, 1)))].append(j)
        before += n
    return out


def gpt_blocks_of_shapes(shapes: list[tuple[int, ...]]) -> list[int] | None:
    """For the shapes of a lowcomm GPT (embeddings, n_layer blocks of 8 tensors, final
    norm), each tensor's block index (-1 outside blocks); None for any other model."""
    if len(shapes) < 12 or (len(shapes) - 4) % 8:
        return None
    d = shapes[0][-1]
    block = [(d,), (d,), (3 * d, d), (d, d), (d,), (d,), (4 * d, d), (d, 4 * d)]
    n_layer = (len(shapes) - 4) // 8
    if len(shapes[0]) != 2 or len(shapes[1]) != 2 or shapes[1][1] != d or \
            [tuple(s) for s in shapes[-2:]] != [(d,), (d,)]:
        return None
    if any([tuple(s) for s in shapes[2 + 8 * b:10 + 8 * b]] != block for b in range(n_layer)):
        return None
    return [-1, -1] + [b for b in range(n_layer) for _ in range(8)] + [-1, -1]


@register("streaming_diloco")
class StreamingDiLoCo(OuterSync):
    Options = StreamingOptions

    def __init__(self, model, comm, make_optimizer, accum=1, schedule=None, options=None):
        super().__init__(model, comm, make_optimizer, accum, schedule, options)
        self.tau, self.alpha = self.options.fragment_delay, self.options.merge_alpha
        self.in_flight: dict[int, tuple] = {}  # fragment i -> its collectives in flight

    def fragment_params(self, model, params):
        return fragment_of_params(model, params, self.options.fragments)

    @classmethod
    def layout(cls, model: nn.Module, F: int) -> list[int]:
        """Numel of each fragment of `model`."""
        params = [p for p in model.parameters() if p.requires_grad]
        return [sum(p.numel() for p in ps) for ps in fragment_of_params(model, params, F)]

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        # A fragment's reduction runs behind the next τ inner steps' compute; only what
        # is left when its merge is due is waited for.
        tau = options.fragment_delay * cost.compute_s
        return sum(max(0.0, cost.price(op.collective, op.nbytes) - tau) * cls.plan_rate(op, options, cost.steps)
                   for op in plan)

    @classmethod
    def fragment_count(cls, options) -> int:
        return options.fragments

    @classmethod
    def fragment_numels(cls, num_params, options, shapes=None):
        F = options.fragments
        if shapes is None:
            return [num_params // F + (1 if f < num_params % F else 0) for f in range(F)]
        numels = [math.prod(s) for s in shapes]
        blocks = gpt_blocks_of_shapes(shapes)
        if blocks is not None:
            return [sum(n for n, b in zip(numels, blocks) if max(b, 0) % F == f) for f in range(F)]
        return [sum(numels[j] for j in group) for group in contiguous_groups(numels, F)]

    # -- overlapped syncs --------------------------------------------------------------
    def _start_sync(self, i: int, t: int) -> None:
        delta, tau, c = self._delta(i), self.since[i], self._mean_compute()
        self.since[i] = 0
        self.in_flight[i] = self._issue(i, delta, tau, c)
        self.pending[i] = t + self.tau

    def _collect(self) -> None:
        """Finish every sync in flight (the merges still wait for their step)."""
        for i in sorted(self.in_flight):
            self._finish_flight(i)

    def _finish_flight(self, i: int) -> None:
        """Wait for fragment i's collectives, combine, outer step; θ_f,global is then new."""
        avg, infos = self._complete(self.in_flight.pop(i))
        self._outer_step(i, avg)
        self.landed[i] = infos if infos is not None else avg.new_zeros(0)  # a tensor: state holds it

    def _merge_due(self, t):
        for i in sorted(self.pending):
            if t is None or self.pending[i] <= t:
                if i in self.in_flight:
                    self._finish_flight(i)
                del self.pending[i]
                self._land(i, self.landed.pop(i), alpha=self.alpha)

    def _update_rate(self, infos):
        if infos is not None and infos.numel():
            super()._update_rate(infos)

    def release(self) -> None:
        for ticket in self.in_flight.values():  # never leave a collective unwaited
            for h in ticket[1]:
                h.wait()
        self.in_flight.clear()

    def report(self) -> dict:
        per_sync = self.sync_bytes()
        return {**super().report(), "fragments": self.options.fragments,
                "fragment_delay": self.tau, "merge_alpha": self.alpha,
                "fragment_numels": [sum(p.numel() for p in ps) for _, ps in self.fragments],
                "bytes_per_full_round_per_rank": sum(per_sync)}

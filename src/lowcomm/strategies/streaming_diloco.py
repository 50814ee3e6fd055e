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

from dataclasses import dataclass

from ..errors import UsageError
from ..models.layout import layout_of
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


@register("streaming_diloco")
class StreamingDiLoCo(OuterSync):
    Options = StreamingOptions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tau, self.alpha = self.options.fragment_delay, self.options.merge_alpha
        self.in_flight: dict[int, tuple] = {}  # fragment i -> its collectives in flight

    def fragment_params(self):
        return [[self.params[j] for j in group] for group in layout_of(self.model).fragments(self.options.fragments)]

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
    def fragment_numels(cls, layout, options):
        return layout.fragment_numels(options.fragments)

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

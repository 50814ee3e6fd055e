"""`--sync-by time` for the local-SGD family: inner phases sized to each worker's speed.

A trainer step is then one *slot*: the time a 1x worker takes for one inner step. A rank
does at most one inner step per slot; the fastest rank does one in every slot, a rank k×
slower about one in k (its other slots are empty trainer steps that return at once with 0
micro-batches). So --steps counts slots: the same --steps and --sync-every mean the same
wall time for every rank, and the fastest rank sees the tokens it would see under
--sync-by steps. Syncs stay at fixed slots (every H trainer steps), so ranks never need a
collective to agree *when* to sync; how many inner steps a rank fits is decided locally,
by a deadline in its own time:

    rank r steps in a slot  ⇔  own_s + c_r/2 ≤ sched_s + c_ref

c_r is its own mean cost per inner step (data, forward/backward with the emulated
slowdown, inner optimizer step); own_s sums only this rank's slots (not evaluations or
log gathers), and the 1x schedule sched_s adds c_ref, the fastest rank's mean cost, per
slot: the step must end (to the half) within the schedule's time at the end of the slot.
This corrects itself: a step that ran long makes the next slots empty. The costs ride
along each sync (16 bytes per rank, `step_info`: an all_gather beside the all-reduce, or
inside an all-gathered payload), plus one calibration all_gather after trainer step 2
(step 1 pays one-off set-up costs), so the first period is sized too.

Pseudo-gradients of ranks that ran τ_r inner steps are combined by FedNova's normalized
averaging (Wang et al. 2020, vanilla-SGD form with p_r = 1/W):

    Δ = τ_eff · Σ_r (1/W') Δ_r/τ_r,   τ_eff = mean τ_r over the W' ranks that stepped

which is the plain mean when all τ_r are equal. The trainer's log gathers (--log-every)
and evaluations are sync points too: with a slow rank, set --log-every to a multiple of H
so they coincide with outer syncs. Push-style users (`backward()`) always get an inner
step per trainer step (empty slots exist only in the pull-style `step()`).
"""
from __future__ import annotations

import time

import torch

from ..comm import Comm
from ..contract.plan import PlannedOp

INFO_BYTES = 16  # float64 (τ_r, c_r) per rank
CALIBRATION = "calibration: step times after trainer step 2 (--sync-by time)"


class SlotClock:
    """One rank's slots: its own time in them, the 1x schedule's, and its step costs."""

    STATE = ("own_s", "sched_s", "c_ref", "c_mine", "is_ref", "costs")

    def __init__(self) -> None:
        self.own_s, self.sched_s = 0.0, 0.0     # this rank's time in its slots; the 1x schedule's
        self.c_ref, self.c_mine = 0.0, 0.0      # the fastest rank's mean cost per inner step; this rank's
        self.is_ref = True                      # this rank is the fastest (until told otherwise)
        self.costs: list[float] = []            # seconds of each inner step since the last exchange

    def steps_this_slot(self) -> bool:
        """The reference rank steps in every slot; another when the step ends in time (above)."""
        if self.is_ref or self.c_ref <= 0:
            return True
        return self.own_s + self.c_mine / 2 <= self.sched_s + self.c_ref

    def record(self, cost: float) -> None:
        """One inner step's whole cost: data, compute (emulated slowdown included), optimizer."""
        self.costs.append(cost)

    def end_slot(self, t: int, t0: float, comm: Comm) -> None:
        """Trainer step t (from 1), begun at perf_counter() t0, is over."""
        self.own_s += time.perf_counter() - t0
        self.sched_s += self.c_ref
        if t == 1:
            self.costs = []  # the first step pays one-off set-up costs: not a speed sample
        elif t == 2:  # calibration: size the rest of the first period already
            self.learn(gather_info(comm, 0, self.mean_cost()), comm.rank)

    def mean_cost(self) -> float:
        """Mean cost of one inner step since the last exchange (the mean, not a median: the
        schedule must add up to the fast rank's real time); 0 when it took none. Resets."""
        c = sum(self.costs) / len(self.costs) if self.costs else 0.0
        self.costs = []
        if c > 0:
            self.c_mine = c
        return c

    def learn(self, infos: torch.Tensor | None, rank: int) -> None:
        """Every rank's (τ, c) from an exchange: the reference is the fastest that stepped."""
        if infos is None or not infos.numel():
            return
        c = infos[:, 1]
        seen = c[c > 0]
        if seen.numel():
            self.c_ref = float(seen.min())
            self.is_ref = float(c[rank]) > 0 and int(torch.where(c > 0, c, torch.inf).argmin()) == rank

    def state_dict(self) -> dict:
        return {k: list(self.costs) if k == "costs" else getattr(self, k) for k in self.STATE}

    def load_state_dict(self, sd: dict) -> None:
        for k in self.STATE:
            setattr(self, k, sd[k])


def step_info(tau: int, c: float) -> torch.Tensor:
    """What rides along a sync: inner steps since the last one, mean cost of each."""
    return torch.tensor([float(tau), c], dtype=torch.float64)


def gather_info(comm: Comm, tau: int, c: float) -> torch.Tensor:
    """Every rank's (τ, c), as a (W, 2) tensor."""
    out = torch.empty(comm.world * 2, dtype=torch.float64)
    comm.all_gather(out, step_info(tau, c))
    return out.view(comm.world, 2)


def fednova_weights(taus: torch.Tensor) -> torch.Tensor:
    """w_r with Δ = Σ_r w_r Δ_r: τ_eff / (W' τ_r) over the W' ranks that stepped (τ_r > 0)."""
    taus = taus.double()
    active = taus > 0
    if not bool(active.any()):
        return torch.zeros_like(taus)
    tau_eff = taus[active].mean()
    return torch.where(active, tau_eff / (int(active.sum()) * taus.clamp(min=1)), torch.zeros_like(taus))


def fednova_scale(tau: int) -> float:
    """What a rank multiplies Δ_r by before a summing all-reduce: 1/τ_r (0 if it never stepped)."""
    return 1.0 / tau if tau > 0 else 0.0


def fednova_factor(taus: torch.Tensor) -> float:
    """What the all-reduced Σ_r Δ_r/τ_r is multiplied by: τ_eff / W'."""
    active = int((taus > 0).sum())
    return float(taus[taus > 0].mean()) / active if active else 0.0


def calibration_op(world: int) -> PlannedOp:
    return PlannedOp("all_gather", world * INFO_BYTES, every=1, offset=2, what=CALIBRATION)


def is_calibration(op: PlannedOp) -> bool:
    return op.what == CALIBRATION

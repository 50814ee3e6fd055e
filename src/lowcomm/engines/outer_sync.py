"""The outer-sync engine of the local-SGD family (DiLoCo, Streaming DiLoCo, SparseLoCo).

The algorithm (a strategy file) runs the inner steps and the outer optimizer; this engine
keeps everything between them, and never calls back into the algorithm: the strategy
calls it, through the schedule that orders these steps (outer_schedule.py's OuterSchedule,
a subclass: synchronous, streaming, one period late, eager). A fragment's sync goes

    issue(t)     Δ_f,r = θ_f,global − θ_f,r (a snapshot), its reduction started (outer_wire.py)
    in flight    the strategy runs `delay` more inner steps on the stale local θ
    wait         -> the combined Δ_f: the strategy's outer step updates θ_f,global
    merge(t+τ)   θ_f,local ← α·θ_f,local + (1−α)·θ_f,global (α from the strategy)

and the engine owns: the fragments (tensor groups of the model's layout, models/layout.py)
and their fp32 θ_global; the schedule (fragment f of F syncs at the trainer steps t with
(t − ⌊f·H/F⌋) mod H = 0, t ≥ 1, so F syncs spread over each period H); the wire format
and its error-feedback residuals; what is in flight, landed and pending; the step info
the --sync-by time clock needs (sync_by_time.py); --eager's stand-in offsets (eager.py);
--attack's emulated bad workers (robust/emulation.py: what an attacker hands the wire in place
of its Δ_r); the state to checkpoint, where a reduction still in flight is this rank's part of
it, sent again (`reissue`) on the group of the run that loads it. The plan's price:
outer_contract.py.

Why not overlap.py's Background engine: its job runs the collectives on a communication
thread, and a job still in flight when the trainer step ends races the trainer's own
between-step collectives (log gathers, evaluation) on the same process group -- ranks
then pair different collectives (gloo: "Received data size doesn't match expected
size"). Instead a fragment's collectives are issued asynchronously (Comm's async_op) from
the compute thread, in the same order on every rank, and gloo progresses them on its own
threads while the inner steps run; only the wait can be exposed.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from ..comm import Comm
from ..contract.context import flat_of, write_flat
from ..contract.parts import LOCAL, Part, attributes, optimizer_part
from ..robust.aggregators import spread_over
from .eager import StandIn
from .outer_wire import Outgoing, OuterWire, Ticket, WireFormat
from .sync_by_time import SlotClock


def sync_offset(f: int, every: int, fragments: int) -> int:
    """Fragment f of F's place in the period: it syncs at the trainer steps t ≡ ⌊f·H/F⌋ (mod H)."""
    return (f * every) // fragments


def syncs_at(t: int, offset: int, every: int) -> bool:
    """Whether a fragment at `offset` syncs at trainer step t (from 1; never at step 0)."""
    return t >= (offset or every) and (t - offset) % every == 0


def merges_at(step: int, every: int, fragments: int, delay: int) -> bool:
    """Does some fragment's sync merge at trainer step `step` (from 1): ⌊f·H/F⌋ + τ (mod H)?"""
    return any(syncs_at(step - delay, sync_offset(f, every, fragments), every) for f in range(fragments))


class OuterSync:
    """Fragment-wise outer syncs of `params` cut into `groups` (tensor indices per fragment,
    empty ones never sync): Δ on the wire every `every` trainer steps, merged `delay` later."""

    def __init__(self, params: list[nn.Parameter], groups: list[list[int]], comm: Comm, every: int,
                 fmt: WireFormat, timed: bool = False, delay: int = 0, eager_outer=None, attackers=None,
                 inside=None):
        self.comm, self.every, self.delay = comm, every, delay
        self.attackers = attackers  # --attack: robust.Attackers, else None
        self.clock = SlotClock() if timed else None  # --sync-by time: the step info it needs rides along
        self.count = len(groups)  # F, empty fragments included: they keep their place in the schedule
        self.fragments = [(f, [params[j] for j in g]) for f, g in enumerate(groups) if g]
        self.wire = OuterWire(fmt, fednova=timed)
        self.wire.spread = spread_over(inside) if inside is not None else None  # across replicas: norms summed there
        self.globals = [nn.Parameter(flat_of(ps).float().clone(), requires_grad=False) for _, ps in self.fragments]
        n = len(self.fragments)
        self.since = [0] * n                          # inner steps since fragment i's last sync (τ_r)
        self.tokens = [0] * n                         # tokens trained since fragment i's last sync
        self.in_flight: dict[int, Ticket] = {}        # fragment i -> its reduction in flight
        self.landed: dict[int, torch.Tensor] = {}     # fragment i -> (τ, c) of a reduction done, not merged
        self.pending: dict[int, int] = {}             # fragment i -> trainer step its merge is due
        self.arrived: dict[int, torch.Tensor] = {}    # fragment i -> a combined Δ waiting for its outer step
        self.resend: dict[int, Outgoing] = {}         # fragment i -> this rank's part of a reduction to re-issue
        self.syncs = 0                                # merges done (diloco: outer steps)
        # --eager: this worker's stand-in offsets (eager.py), stepped by `eager_outer(params)`
        self.stand_in = StandIn(self.globals, eager_outer) if eager_outer is not None else None

    # -- the schedule -------------------------------------------------------------
    def inner_step(self, cost: float, tokens: int = 0) -> None:
        """This rank took an inner step costing `cost` seconds, training `tokens` tokens."""
        self.since = [s + 1 for s in self.since]
        self.tokens = [t + tokens for t in self.tokens]
        if self.clock is not None:
            self.clock.record(cost)

    def steps_this_slot(self) -> bool:
        """--sync-by time: whether this rank has an inner step in the next slot (else always)."""
        return self.clock is None or self.clock.steps_this_slot()

    def end_slot(self, t: int, t0: float) -> None:
        """Trainer step t (from 1), begun at perf_counter() t0, is over (--sync-by time's clock)."""
        if self.clock is not None:
            self.clock.end_slot(t, t0, self.comm)

    def owed(self) -> bool:
        """A sync is owed: inner steps since a fragment's last one, or a merge pending."""
        return any(self.since) or bool(self.pending)

    def due(self, t: int) -> list[int]:
        """The fragments whose sync is due at trainer step t (from 1)."""
        return [i for i, (f, _) in enumerate(self.fragments) if syncs_at(t, sync_offset(f, self.every, self.count),
                                                                          self.every)]

    def issue_due(self, t: int, delay: int | None = None) -> None:
        """Start the syncs due at trainer step t (from 1); each merges at t + delay (the engine's τ
        unless given: --outer-delay-warmup's syncs merge at once)."""
        for i in self.due(t):
            self.issue(i, t + (self.delay if delay is None else delay))

    def issue(self, i: int, merge_at: int) -> torch.Tensor:
        """Start fragment i's sync now: Δ against where this worker started from (θ_global, plus
        its eager stand-in); it merges at `merge_at`. Returns this rank's Δ."""
        return self._issue(i, merge_at, self._mean_cost())

    def issue_all(self) -> None:
        """The final sync: every fragment now, merged at once (call merges_due(None))."""
        c = self._mean_cost()
        for i in range(len(self.fragments)):
            self._issue(i, 0, c)

    def _mean_cost(self) -> float:
        return self.clock.mean_cost() if self.clock is not None else 0.0

    def _issue(self, i: int, merge_at: int, c: float) -> torch.Tensor:
        f, ps = self.fragments[i]
        delta, key, att = self.start(i) - flat_of(ps).float(), f"fragment{f}", self.attackers
        sent = delta if att is None else att.values(self.comm, key, delta)  # --attack: what it hands the wire
        out = self.wire.prepare(key, sent, self.since[i], c, [p.numel() for p in ps], self.tokens[i])
        if att is not None:  # a replay (copy, stale) sends what the wire sent before
            out.data = att.payload(self.comm, key, out.data)
        self.in_flight[i] = self.wire.send(self.comm, out)
        self.since[i] = self.tokens[i] = 0
        self.pending[i] = merge_at
        return delta

    def start(self, i: int) -> torch.Tensor:
        """Where this worker's inner steps on fragment i start from: θ_global, plus its eager offset."""
        g = self.globals[i].detach()
        return g if self.stand_in is None else g + self.stand_in.offsets[i].detach()

    def reissue(self) -> None:
        """Send again this rank's part of the reductions a loaded state had in flight, on the
        current group (collective: every rank calls it at the same point; nothing to send is free)."""
        for i in sorted(self.resend):
            self.in_flight[i] = self.wire.send(self.comm, self.resend.pop(i))

    def wait(self, *fragments: int) -> list[tuple[int, torch.Tensor]]:
        """Finish the reductions in flight (of `fragments`, else all): [(i, combined Δ_i)],
        for the strategy's outer step on globals[i]."""
        self.reissue()
        out = []
        for i in sorted(fragments or self.in_flight):
            if i in self.in_flight:
                avg, infos = self.wire.complete(self.in_flight.pop(i))
                self.landed[i] = infos if infos is not None else avg.new_zeros(0)  # a tensor: state holds it
                out.append((i, avg))
        return out

    # -- one outer step late (--outer-delay 1): a mean waits for its step -------------------
    def drain(self, *fragments: int) -> None:
        """Finish the reductions in flight (of `fragments`, else all), keeping each combined Δ
        until its outer step is due (`take_previous`): waiting early changes nothing."""
        for i, avg in self.wait(*fragments):
            self.arrived[i] = avg

    def take_previous(self, i: int) -> torch.Tensor | None:
        """Fragment i's combined Δ of the period before (waited for if still in flight: the only
        wait left exposed), None before its first sync."""
        self.reissue()
        if i in self.in_flight:
            self.drain(i)
        return self.arrived.pop(i, None)

    def merges_due(self, t: int | None) -> list[int]:
        """Fragments whose merge is due at trainer step t (None: all pending)."""
        return [i for i in sorted(self.pending) if t is None or self.pending[i] <= t]

    def merge(self, i: int, alpha: float, steps: int = 1, settled: bool = True) -> None:
        """θ_f,local ← α·θ_f,local + (1−α)·θ_f,global (after `wait`): fragment i's sync is done.
        `steps`: the outer steps it applied (--outer-delay 1: none at the first sync, two at the
        final one); `settled` False: a newer sync of fragment i is already in flight (--outer-delay 1)."""
        if settled:
            del self.pending[i]
        ps, g = self.fragments[i][1], self.start(i)
        write_flat(g if alpha == 0.0 else alpha * flat_of(ps).float() + (1 - alpha) * g, ps)
        self.syncs += steps
        infos = self.landed.pop(i, None)  # none before --outer-delay 1's first mean has landed
        if self.clock is not None and infos is not None:
            self.clock.learn(infos, self.comm.rank)

    # -- between steps ---------------------------------------------------------------
    @contextmanager
    def globals_in_model(self):
        """θ_global in the model's parameters (landed reductions only); the local θ back after."""
        params = [p for _, ps in self.fragments for p in ps]
        local = flat_of(params).clone()
        for (_, ps), g in zip(self.fragments, self.globals):
            write_flat(g.detach(), ps)
        try:
            yield
        finally:
            write_flat(local, params)

    @torch.no_grad()
    def restart_from_globals(self) -> None:
        """Every fragment's local θ <- θ_global (and its eager offset): where a worker starts (a joiner too)."""
        for i, (_, ps) in enumerate(self.fragments):
            write_flat(self.start(i), ps)

    def use_comm(self, comm: Comm) -> None:
        """The next syncs run on `comm` (nothing may be in flight: `wait` first; a part still
        to re-issue goes out on `comm`)."""
        assert not self.in_flight, "the group changed while an outer sync is in flight"
        self.comm = comm

    def bytes_per_sync(self) -> list[int]:
        """Wire bytes one rank sends for each fragment's sync."""
        W, fmt, fednova = self.comm.world, self.wire.fmt, self.wire.fednova
        plans = [fmt.plan([p.numel() for p in ps], W, self.every, 0, f, fednova) for f, ps in self.fragments]
        return [sum(op.wire_bytes(W) for op in plan) for plan in plans]

    def report(self, steps: int) -> dict:
        per_step = self.wire.compress_s / max(steps, 1)
        return {"outer_syncs": self.syncs, "bytes_per_sync_per_rank": max(self.bytes_per_sync()),
                "compress_s": self.wire.compress_s, "compress_s_per_step": per_step,
                "global_copy_bytes": sum(g.numel() * g.element_size() for g in self.globals),
                "aggregate": self.wire.aggregator.spec,
                **(self.attackers.report() if self.attackers is not None else {})}

    def state_parts(self) -> dict[str, Part]:
        """The engine's state (contract/parts.py): θ_global and the schedule's bookkeeping, alike on
        every worker; the rest each worker's own: what it trained since a sync (steps, tokens), its
        part of a reduction in flight (re-issued when loaded), its error-feedback residuals and its
        --eager stand-in (a joiner starts with none of them: no Δ, no tokens, zero residual)."""
        parts = {"globals": Part(lambda: [g.detach().clone() for g in self.globals], self._load_globals),
                 "schedule": Part(self._schedule, self._load_schedule),
                 **attributes(self, "since", "tokens", kind=LOCAL),
                 "in_flight": Part(self._in_flight, self._load_in_flight, LOCAL),
                 "outer_residuals": Part(self.wire.state_dict, self.wire.load_state_dict, LOCAL)}
        if self.stand_in is not None:
            parts["stand_in"] = Part(self.stand_in.state_dict, self.stand_in.load_state_dict, LOCAL)
            parts["stand_in_outer"] = optimizer_part(self.stand_in.outer, LOCAL)  # the offsets' momentum
        return parts

    def _load_globals(self, saved: list[torch.Tensor]) -> None:
        for g, value in zip(self.globals, saved, strict=True):
            g.data.copy_(value)

    def _schedule(self) -> dict:
        return {"pending": dict(self.pending), "landed": {i: v.clone() for i, v in self.landed.items()},
                "arrived": {i: v.clone() for i, v in self.arrived.items()}, "syncs": self.syncs,
                **(self.clock.state_dict() if self.clock is not None else {})}

    def _load_schedule(self, sd: dict) -> None:
        self.pending, self.syncs = dict(sd["pending"]), sd["syncs"]
        self.landed = {i: v.clone() for i, v in sd["landed"].items()}
        self.arrived = {i: v.clone() for i, v in sd["arrived"].items()}
        if self.clock is not None:
            self.clock.load_state_dict(sd)

    def _in_flight(self) -> dict:
        """A reduction in flight as this rank's part of it (to re-issue when loaded)."""
        sent = {i: t.sent.state() for i, t in self.in_flight.items()}
        sent.update({i: out.state() for i, out in self.resend.items()})
        return {i: {k: v.clone() for k, v in part.items()} for i, part in sent.items()}

    def _load_in_flight(self, sent: dict) -> None:
        assert not self.in_flight, "load_state_dict() with an outer sync in flight"
        self.resend = {i: self.wire.resume({k: v.clone() for k, v in part.items()}, f"fragment{self.fragments[i][0]}",
                                           [p.numel() for p in self.fragments[i][1]])
                       for i, part in sent.items()}

    def release(self) -> None:
        """Never leave a collective unwaited. After a failed collective (a member lost, --elastic
        rolls back) a sync in flight on that group fails too, and nothing of it is kept."""
        for ticket in self.in_flight.values():
            for h in ticket.handles:
                try:
                    h.wait()
                except RuntimeError:  # gloo's DistBackendError: the group is broken, drop the sync
                    continue
        self.in_flight.clear()
        self.resend.clear()

"""When the local-SGD family's outer steps happen: the schedule beside the fragments.

The strategy runs the inner step and the outer optimizer; at the end of each trainer step it
asks this engine for the means whose outer step is due, and the engine, between them, issues
the syncs, waits, merges and keeps the stand-ins (it never calls the strategy back):

    for i, mean in sync.means_at(t, t0, final):   # the syncs due at t issued, the means due landed
        θ_i,global ← OuterOpt(θ_i,global, mean)     # the strategy's outer step
        (the engine merges fragment i once the outer step is taken)

The schedules, chosen by the options (outer_options.py):
- synchronous (DiLoCo): at the end of every H-th step the sync is issued, waited for, its
  outer step taken, and every worker restarts from θ_global (merge with α = 0);
- streaming (Streaming DiLoCo, F, τ, α): fragment f syncs at t ≡ ⌊f·H/F⌋ (mod H); its mean
  lands τ steps later, its outer step is taken then and the merge is
  θ_f,local ← α·θ_f,local + (1−α)·θ_f,global;
- one period late (--outer-delay 1, PCCL's async DiLoCo, Kale et al.'s delayed outer
  gradients): at a fragment's sync this period's Δ is issued against the θ_global the period
  started from, the mean issued a period ago (reduced behind this period's inner steps) takes
  its outer step, and the next period starts from the new θ_global; the first two periods
  start from θ_0. The syncs of the first --outer-delay-warmup steps still wait for their mean
  (as DiLoCo's own runs start from a synchronously trained model);
- eager (--eager, Kale et al.'s eager updates): one period late, Δ_r/W stands in for this
  worker's share of the mean just issued, in place of its share of the one that landed
  (eager.py); the next period starts from θ_global plus this worker's stand-in offset.
A run that ends mid-period syncs every fragment once more at its last step (or when closed,
`final_means`), each mean waited for, so the saved model is θ_global.

What the schedule means for a plan and for --elastic: outer_contract.py.
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..contract.parts import Part
from ..robust import attackers_of, name_by_slot, untrusted_parts
from .outer_options import OuterSyncOptions
from .outer_scoring import OuterScoring
from .outer_sync import OuterSync

Means = Iterator[tuple[int, torch.Tensor]]  # (fragment i, the combined Δ of its sync)


class OuterSchedule(OuterSync):
    """The outer-sync engine with its schedule, built from the family's options `o`:
    `make_outer(params)` is the strategy's outer optimizer (--eager steps its stand-ins with one)."""

    def __init__(self, params, layout, comm, o: OuterSyncOptions, make_outer, model=None, inside=None):
        fragments, delay, self.alpha = o.streaming()
        super().__init__(params, layout.fragments(fragments), comm, o.sync_every, o.wire(),
                         timed=o.sync_by == "time", delay=delay, eager_outer=make_outer if o.eager else None,
                         attackers=attackers_of(o), inside=inside)
        self.options = o
        self.scoring = OuterScoring(self, model, o, inside) if o.score else None
        if self.scoring is not None:
            self.wire.admit = self.scoring.admit

    def state_parts(self) -> dict[str, Part]:
        """The engine's parts, and --score's scoreboard and held sequences (outer_scoring.py), and
        --attack's rounds and replays (the attacker's own), where they run."""
        return {**super().state_parts(), **untrusted_parts(self.attackers, self.scoring)}

    def name_members(self, slots) -> None:
        """Under --elastic: the slot (the launcher's worker number, stable across quorums) of each
        rank of this membership's group, by which --attackers and --score name a worker."""
        name_by_slot(slots, self.attackers, self.scoring)

    def report(self, steps: int) -> dict:
        return {**super().report(steps), **(self.scoring.report() if self.scoring is not None else {})}

    def release(self) -> None:
        super().release()
        if self.scoring is not None:  # its hook off the model, which an elastic member keeps for its next run
            self.scoring.held.close()

    def means_at(self, t: int, t0: float, final: bool) -> Means:
        """The end of trainer step t (from 1, begun at perf_counter() t0; `final`: the run's last)."""
        self.end_slot(t, t0)
        if final:
            yield from self.final_means()
        elif self.options.delayed_at(t):
            yield from self._late(t)
        elif self.options.outer_delay:  # a warm-up sync: waited for at once, nothing left in flight
            self.issue_due(t, delay=0)
            yield from self._merged(t, 0.0)
        else:
            yield from self._merged(t, self.alpha)  # syncs issued τ steps ago
            self.issue_due(t)
            yield from self._merged(t, self.alpha)  # τ = 0: at once

    def _late(self, t: int) -> Means:
        """One period late: the mean of the period before takes its step as this period's goes out."""
        for i in self.due(t):
            previous = self.take_previous(i)  # its wait: all that is exposed
            mine = self.issue(i, t + self.every)  # reduced behind the next period's inner steps
            if previous is not None:
                yield i, previous
            if self.stand_in is not None:  # --eager: Δ_r/W stands in for this rank's share of the new mean
                self.stand_in.replace(i, mine / self.comm.world)
            self.merge(i, 0.0, steps=int(previous is not None), settled=False)

    def _merged(self, t: int | None, alpha: float) -> Means:
        """The merges due at step t (None: all pending), each after its mean's outer step."""
        for i in self.merges_due(t):
            yield from self.wait(i)
            self.merge(i, alpha)

    def final_means(self) -> Means:
        """The final sync (at the last step, or at close while one is owed): all end on θ_global."""
        if not self.options.outer_delay:
            yield from self._merged(None, self.alpha)
            self.issue_all()
            yield from self._merged(None, 0.0)
            return
        previous = {i: self.take_previous(i) for i in range(len(self.fragments))}
        self.issue_all()  # the last period's Δ against its base, then both means
        yield from ((i, delta) for i, delta in previous.items() if delta is not None)
        for i, delta in self.wait():
            yield i, delta
            if self.stand_in is not None:  # every mean has landed: no share stands in
                self.stand_in.withdraw(i)
            self.merge(i, 0.0, steps=1 + (previous[i] is not None))

    def means_landed(self, t: int) -> Means:
        """Between steps (before trainer step t): the reductions in flight, waited for. One period
        late (past the warm-up) each mean is kept for its step, one period after it was issued."""
        if self.options.delayed_at(t):
            self.drain()
            return
        yield from self.wait()

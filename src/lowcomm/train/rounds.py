"""The local-SGD family under --elastic: a failed outer sync costs that sync, not the round before
it (for strategies whose rules say `redoes_last_step`, contract/elastic.py).

A local-SGD member trains H inner steps alone between outer syncs, so a peer's death or freeze is
found only when the members reach the sync. Going back to the last commit would throw away every
survivor's H inner steps. So before the step that ends a round, each member keeps its round state
(its local parameters and inner optimizer after H-1 inner steps, the outer state, the records of
those steps); when the sync, or the commit after it, fails, the survivors re-form and go back to
the round state: only the round's last step and its sync are redone, by the members present.

In the new quorum every member says which round step it can return to (none without a round
state on the newest commit). A member holding the newest round's state loads it. A member without
it (a restarted worker, a joiner) holds the committed state the heal gave it and enters the round
at that step having trained nothing: the token-weighted merge counts it for the one step it
trains, and its rows of the round's earlier steps are recorded absent (runlog.absent_vector).
The inner steps a dead member trained in the round are lost with it: they never reach the merge,
and the sync's `outer.tokens_per_member` in steps.jsonl shows the tokens that did.
"""
from __future__ import annotations

from ..comm.objects import all_gather_object
from ..contract.parts import commit_state
from ..metrics.runlog import absent_vector


def snapshot_of(run) -> dict:
    """The run's state as a member of any later membership can load it (collective where the
    strategy's state is sharded: contract/parts.py's commit_state)."""
    return commit_state(run.strategy.state_parts(), run.state_dict())


class RoundState:
    """One member's state before the last step of the current round, if kept."""

    def __init__(self):
        self.kept: dict | None = None

    def keep(self, w) -> None:
        """Before the step that ends a round (w: the ElasticWorker)."""
        if self.kept is None or self.kept["step"] != w.step:
            # the data stream's position too: the round's last step reads on from it
            self.kept = {"step": w.step, "base": w.snapshot["step"], "pending": list(w.progress.pending),
                         "state": {"step": w.step, "strategy": snapshot_of(w.t.run), "draws": w.t.loader.frontier()}}

    def forget(self) -> None:
        """The round committed: its state is of no more use."""
        self.kept = None

    def rejoin(self, w) -> int | None:
        """After a quorum's heal (every member on the newest commit): all members back at the
        newest round step any of them kept, or all on the commit. Returns that step, or None."""
        kept = self.kept is not None and self.kept["base"] == w.snapshot["step"]
        mine = (self.kept["step"], self.kept["state"]["draws"]) if kept else None
        every = all_gather_object(w.t.comm, mine)
        steps = [s for s in every if s is not None]
        if not steps:
            self.kept = None
            return None
        target, draws = max(steps)
        if mine is not None and mine[0] == target:
            w.load(self.kept["state"])
            w.progress.pending = list(self.kept["pending"])
        else:  # in the round from here, having trained none of it
            committed = w.snapshot
            w.load({"step": target, "strategy": {**committed["strategy"], "steps_done": target}, "draws": draws})
            w.progress.pending = [absent_vector() for _ in range(target - committed["step"])]
            self.kept = None
        return target

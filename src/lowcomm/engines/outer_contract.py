"""The contract members a strategy of the local-SGD family answers through its outer-sync
engine: its plan, the plan's price of its schedule (OuterSyncCost, the strategy's cost model),
and its rules under --elastic.

A strategy that holds an `OuterSchedule` as `self.sync`, built from `OuterSyncOptions`
(outer_options.py), names them in its bases: `class DiLoCo(OuterSyncContract, Strategy)`.

The plan: each non-empty fragment's sync at its offset in the period, the --sync-by time
calibration, the final sync of every fragment at the run's last step; a regular sync's
reduction hides behind τ inner steps (streaming), a whole period (one period late, past its
warm-up) or none, the final one behind none.

Under --elastic (contract/elastic.py; the parts: outer_sync.py's state_parts) the commit points are the merges, where every member
holds θ_global and the outer momentum alike: that is the state a joiner receives, as a
torchft DiLoCo fragment registers exactly its global parameters and outer optimizer. The rest
is each worker's own, and a joiner starts it as a fresh worker at step 0 did -- its local θ at
θ_global, no error-feedback residual (zero), nothing trained since the sync. With
--outer-delay 1 a mean is in flight at every commit point; the commit does not wait for it
(that would expose what the delay hides): each member keeps its own part of it (its Δ_r as the
wire carries it, and its tokens) as local state, and a run that loads the state sends the part
again at its next step on its own group (`reissue`): after a member is lost the survivors
re-issue the reduction among themselves, token-weighted, the dead member's part lost with it;
a joiner's part is a fresh worker's (no Δ, no tokens). --eager's stand-in (offset, share
standing in, the offset's momentum) is local too: a joiner starts with none, from θ_global.

"""
from __future__ import annotations

import dataclasses

from ..contract.elastic import ElasticRules
from ..contract.plan import Cost, PlannedOp
from ..robust.costs import defence_work
from .outer_options import outer_step_suffix
from .outer_sync import sync_offset
from .outer_wire import WireFormat
from .sync_by_time import calibration_op, is_calibration
from .token_weights import contribution


class OuterSyncCost(Cost):
    """The outer-sync engine's price (the module docstring): what `lowcomm plan` asks of a
    local-SGD strategy, named by it as its cost model (`cost = OuterSyncCost`)."""

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        return plan_occurrences(op, steps)

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        return exposed_s(plan, lambda op: cost.price(op.collective, op.nbytes),
                         lambda op: cls.plan_rate(op, options, cost.steps), options.hidden_steps() * cost.compute_s,
                         cost.steps, options.outer_delay_warmup if options.outer_delay else 0)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):  # θ, ∇θ, moments, θ_global, momentum (+ residual)
        # (+ --eager's offset, the share standing in and the offset's momentum)
        return (24 + 4 * (options.outer_compress != "none") + 12 * options.eager) * num_params

    @classmethod
    def defence_work(cls, options, world, numel, seq_len):
        return defence_work(options.wire().aggregator, options.score, world, numel, options.score_batches, seq_len,
                            1 / options.sync_every)

    @classmethod
    def plan_label(cls, strategy, options):
        robust = f" {options.wire().aggregator.spec}" if options.robust_wire() else ""  # its all-gather, priced
        suffix = outer_step_suffix(options.outer_delay, options.eager) + robust
        return f"{strategy.name} H={options.sync_every}{suffix}"


class OuterSyncRules(ElasticRules):
    """--elastic's rules for a strategy on the outer-sync engine (the module docstring)."""

    @classmethod
    def commits_at(cls, options, step):
        return options.commits_at(step)

    @classmethod
    def redoes_last_step(cls, options):
        return options.redoes_last_step()

    @classmethod
    def refusal(cls, options, across_replicas):
        if options.sync_by != "steps":
            return ("it needs --sync-by steps: its commit points are the outer syncs, which must fall on the "
                    "same step on every worker")
        return None

    @classmethod
    def options(cls, options):
        # members come and go: each counts for the tokens it trained since the last sync (token-weighted merge)
        return dataclasses.replace(options, outer_weights="tokens")

    @classmethod
    def require_contributors(cls, strategy, n):
        strategy.min_contributors = n

    @classmethod
    def name_members(cls, strategy, slots):
        strategy.sync.name_members(slots)  # --attackers and --score's scoreboard name workers by slot

    @classmethod
    def contribution(cls, strategy) -> dict | None:
        """The last outer sync's workers that contributed and their tokens (--outer-weights tokens)."""
        return contribution(strategy.sync.wire.last_tokens)


class OuterSyncContract:
    """The plan, its end and --elastic's rules for a strategy on the outer-sync engine (a mixin,
    named before Strategy in the bases)."""

    elastic = OuterSyncRules

    min_contributors = 1  # --outer-weights tokens: an outer step needs this many workers that trained

    @classmethod
    def comm_plan(cls, layout, world, options):
        sizes = layout.fragment_sizes(options.streaming()[0])
        return comm_plan(sizes, world, options.sync_every, options.wire(), options.sync_by == "time")

    def quorate(self) -> bool:
        """Did enough workers train since the last sync (tokens > 0)? Always with equal weights."""
        info = OuterSyncRules.contribution(self)
        return info is None or info["contributors"] >= self.min_contributors

    def end_run(self, agree) -> bool:
        """At close, the final sync while any rank owes one (1 while owed: the most over the ranks)."""
        return self.finish(agree(int(self.sync.owed())))


def comm_plan(sizes: list[list[int]], world: int, every: int, fmt: WireFormat, timed: bool) -> list[PlannedOp]:
    """What one rank sends: each non-empty fragment's sync at its offset in the period
    (sizes: every fragment's tensor sizes, empty fragments included), and the --sync-by time
    calibration."""
    F, plan = len(sizes), []
    for f, tensors in enumerate(sizes):
        if tensors:
            plan += fmt.plan(tensors, world, every, sync_offset(f, every, F), f, fednova=timed)
    return plan + ([calibration_op(world)] if timed else [])


def plan_occurrences(op: PlannedOp, steps: int) -> int:
    """Regular syncs before the run's last step, then the final sync (every fragment) at it."""
    if steps < 1:
        return 0
    if is_calibration(op):
        return 1 if steps >= 2 else 0
    return op.occurrences(steps - 1) + 1


def exposed_s(plan: list[PlannedOp], price, rate, hidden_s: float, steps: int | None,
              synchronous_until: int = 0) -> float:
    """Seconds a step waits for the syncs of `plan` (price(op): one occurrence's time; rate(op):
    occurrences per step): a regular sync runs behind `hidden_s` of inner steps before it is
    waited for (τ of them, a period with --outer-delay 1, none otherwise), but for those up to
    step `synchronous_until` (--outer-delay-warmup), which wait in full; the final sync of a
    run of `steps` steps (every fragment at the last step) has nothing left to hide behind, so
    all of its time is exposed -- the fragments issued together, one after another on the link."""
    total = 0.0
    for op in plan:
        counted = steps and not is_calibration(op)
        final = 1 / steps if counted else 0.0
        warm = op.occurrences(min(synchronous_until, steps - 1)) / steps if counted else 0.0
        total += max(0.0, price(op) - hidden_s) * (rate(op) - final - warm) + price(op) * (final + warm)
    return total

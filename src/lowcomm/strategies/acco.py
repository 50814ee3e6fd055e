"""ACCO -- Accumulate While You Communicate (Nabli et al., arXiv 2406.02613).

ZeRO-1's layout plus one communication buffer B. Rounds alternate:

  estimate round (model holds θ_t, B = ∇θ̃_t):
      comm:     θ̃_{t+1} = opt(θ_t; B / N), state snapshot and restored
      compute:  G += ∇θ_t                     (G still holds ∇θ̃_t)
      end:      model <- θ̃_{t+1};  B <- G = ∇θ̃_t + ∇θ_t
  real round:
      comm:     θ_{t+1} = opt(θ_t; B / N)     state kept; the schedule moves on
      compute:  G <- 0;  G += ∇θ̃_{t+1}        at the estimate now in the model
      end:      model <- θ_{t+1};  B <- G = ∇θ̃_{t+1}

Every gradient used for θ_t -> θ_{t+1} was computed at θ_t or an estimate of it,
so there is no stale-gradient bias, and communication hides behind compute.
Start-up, as in the reference code: one micro-batch gradient at θ_0 fills G,
B <- G, and the first round is an estimate round treating θ_0 as θ̃_0.

A trainer step is one round (≥ `accum` micro-batches per rank, so --steps
means the same tokens as for zero1); an optimizer step takes two rounds.
Compute keeps accumulating while the round's communication is in flight, up
to `max_accum` micro-batches, so faster workers contribute more; N is the
all-reduced total. `deterministic=True` computes exactly `accum` per round.
The schedule counts micro-batches, as the reference does: the step index
passed to the schedule is (global micro-batches applied in real rounds so
far) // (W * accum), i.e. how many zero1 steps' worth of data the real
updates have consumed; an estimate round and the real round after it share one lr.
Adaptive rounds mean equal backward() counts can end on different round counts: a
rank that has closed serves its peers' further rounds with no new micro-batch until
a round finds no rank computing (overlap.py), then the model gets the real θ.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

from ..errors import UsageError
from ..engines.flat import ShardedOptions
from ..contract.options import option
from ..engines.overlap import OverlappedStrategy
from ..contract.plan import ONCE, LevelPlans, flat_numel
from .registry import register


@dataclass
class AccoOptions(ShardedOptions):
    deterministic: bool = option(False, "exactly --accum micro-batches per round, whatever the timing")
    max_accum: int = option(0, "most micro-batches per round while communicating (0: 4 x --accum)", min=0)

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        self.rounds_bound(cfg.accum)

    def run_note(self, cfg) -> str | None:
        # At ddp's flags an update takes twice ddp's batch and a run half its updates (the
        # estimate and the real round each compute --accum micro-batches); on a small model that
        # is the difference between leaving the unigram plateau or not (docs/strategies.md).
        b, steps, warmup = cfg.micro_batch, cfg.steps, cfg.optim.warmup_steps
        same = (f"--micro-batch {b // 2} --steps {2 * steps} --warmup {2 * warmup} gives each update ddp's "
                f"batch at the same tokens" if b % 2 == 0 else f"its like-for-like peer is ddp --accum {2 * cfg.accum}")
        return (f"acco's update sums two rounds of --accum {cfg.accum} micro-batch(es): at ddp's flags it makes "
                f"half ddp's updates, each of twice its batch; {same} (docs/strategies.md)")

    def rounds_bound(self, accum: int) -> int:
        """Most micro-batches per round: max_accum (0: 4·accum); below accum is refused,
        through the CLI and TOML (check_run) and the Python API (the constructor) alike."""
        if self.max_accum and self.max_accum < accum:
            raise UsageError(f"--max-accum (acco.max_accum) {self.max_accum} is below --accum {accum}: "
                             f"a round computes at least --accum micro-batches")
        return self.max_accum or 4 * accum


@register("acco")
class ACCO(OverlappedStrategy):
    Options = AccoOptions
    reproducible_options = {"deterministic": True}
    inside_replica = ("ddp",)  # across replica groups: on the tensors each position owns

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deterministic = self.options.deterministic
        self.max_accum = self.options.rounds_bound(self.accum)
        self.starting = True           # the start-up micro-batch at θ_0 comes first
        self.estimate_next = True      # the first round is an estimate round
        self.holds_estimate = False    # does the model hold θ̃ rather than θ?
        self.local_count = 0           # micro-batches summed in G
        self.applied = 0               # global micro-batches in applied real updates
        self.real_rounds = 0
        self.lr = float("nan")

    @classmethod
    def micro_batches_per_step(cls, cost, comm_s, options):
        """A round lasts as long as the slowest worker's `accum` micro-batches or the previous
        round's communication, whichever is longer; every worker keeps computing meanwhile,
        up to max_accum (deterministic: exactly accum). The planner counts the extra tokens."""
        accum = cost.accum
        if options.deterministic or not cost.worker_compute_s:
            return float(accum)
        bound = options.rounds_bound(accum)
        round_s = max(max(cost.worker_compute_s), comm_s)
        per_worker = [min(bound, max(accum, round_s * accum / c)) if c > 0 else bound for c in cost.worker_compute_s]
        return sum(per_worker) / len(per_worker)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # ZeRO-1's, plus the communication buffer B and the estimate round's snapshot of
        # the master shard and its AdamW moments (extra_memory_bytes measures the same).
        n = flat_numel(num_params, world)
        return super().model_state_bytes(num_params, world, options) + cls.flat_bytes(num_params, world, options) \
            + 12 * n // world

    @classmethod
    def level_plans(cls, layout, replicas, size, options):
        # The start-up micro-batch's gradients are reduced inside the replica once more (the
        # count goes with the first round).
        plans = super().level_plans(layout, replicas, size, options)
        startup = [replace(op, every=ONCE, offset=1, what=f"{op.what}, at start-up")
                   for op in plans.intra if op.collective == "reduce_scatter"]
        return LevelPlans(plans.intra + startup, plans.cross)

    def begin_step(self, ctx):
        if self.starting:  # G must hold ∇θ_0 before the first round can start
            self.flat.zero_grad()
        else:
            self.start_round()

    def start_round(self):
        estimate = self.estimate_next
        if estimate:  # the estimate and the real round that follows share one lr
            self.lr = self.set_lr(self.applied // (self.data_parallel_ranks * self.accum))
        self.launch(estimate)
        if not estimate:
            self.flat.zero_grad()
            self.local_count = 0

    def after_backward(self, ctx):
        self.flat.check_views()
        if self.starting:  # start-up: one micro-batch at θ_0 fills G and B
            self.starting = False
            self.local_count = 1
            self.load_round(self.local_count)
            self.start_round()
            ctx.micro = 0  # the start-up micro-batch belongs to no round
            return False
        self.local_count += 1
        # Keep computing while the round is in flight: at least accum, at most max_accum.
        if ctx.micro < self.accum or (not self.deterministic and ctx.micro < self.max_accum
                                      and self.rounds.in_flight()):
            return False
        self.end_round(ctx)
        return True

    def serve_step(self):
        """Closed: the next round as the loop would take it, with no new micro-batch (an estimate
        round still sends the gradients G holds; G is zeroed when a real round starts)."""
        if self.starting:  # closed before the start-up micro-batch: the start-up with none
            self.starting = False
            self.flat.zero_grad()
            self.load_round(0)
        if not self.rounds.engine.pending:
            self.start_round()
        return self.end_round(None)

    def settle(self):
        """After the last round the model gets the real θ (an estimate round's θ̃ is not kept)."""
        if self.holds_estimate:
            self.flat.params.copy_(self.comm.meta_all_gather(self.shard_opt.own_params()).view(-1))
            self.holds_estimate = False
            self.share_inside(counted=False)  # bookkeeping, as the gather above

    def end_round(self, ctx):
        """Land the round in flight; False when no rank computed in it (the run is over)."""
        total = self.rounds.wait()
        if self.rounds.ended:
            return False
        if self.rounds.skipped and ctx is not None:  # G may still hold the bad gradient: the next real round zeroes it
            ctx.skip()
        estimate = self.estimate_next
        if not estimate:
            self.applied += total
            self.real_rounds += 1
        self.rounds.swap_in()  # θ̃_{t+1} after an estimate round, θ_{t+1} after a real one
        self.load_round(self.local_count)
        self.holds_estimate = estimate
        self.estimate_next = not estimate
        if ctx is not None:
            ctx.lr = self.lr
        return True

    @contextmanager
    def swapped_for_eval(self):
        """After an estimate round the model holds θ̃; evaluate the real θ (gathered
        from the master shards as bookkeeping traffic) and put θ̃ back after."""
        if not self.holds_estimate:
            yield self.model
            return
        estimate = self.flat.params.clone()
        gathered = self.comm.meta_all_gather(self.shard_opt.own_params())
        self.flat.params.copy_(gathered.view(-1))
        try:
            yield self.model
        finally:
            self.flat.params.copy_(estimate)

    def extra_state(self):
        return {**super().extra_state(), "starting": self.starting,
                "estimate_next": self.estimate_next, "holds_estimate": self.holds_estimate,
                "local_count": self.local_count, "applied": self.applied,
                "real_rounds": self.real_rounds, "lr": self.lr}

    def load_extra_state(self, sd):
        super().load_extra_state(sd)
        for key in ("starting", "estimate_next", "holds_estimate", "local_count", "applied",
                    "real_rounds", "lr"):
            setattr(self, key, sd[key])

    def extra_memory_bytes(self) -> int:
        """Bytes ACCO holds beyond ZeRO-1, measured on the live tensors: the
        communication buffer B, the separate fp32 master shard (ZeRO-1 aliases
        it to the fp32 parameters) and the peak estimate-round snapshot."""
        b = self.rounds.buffer
        m = self.shard_opt.master
        zero1_aliases = self.flat.params.dtype == m.dtype
        return (b.numel() * b.element_size() + (m.numel() * m.element_size() if zero1_aliases else 0)
                + self.rounds.snapshot_bytes)

    def report(self) -> dict:
        return {"rounds": self.steps_done, "real_rounds": self.real_rounds,
                "optimizer_steps": self.real_rounds, "deterministic": self.deterministic,
                "max_accum": self.max_accum, "extra_memory_bytes_vs_zero1": self.extra_memory_bytes()}

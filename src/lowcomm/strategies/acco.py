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

A trainer step is one optimizer update: an estimate round then a real round, each computing
half of the step's batch, as the paper splits each worker's mini-batch (the CLI's loader cuts
each --micro-batch in two: `micro_batch_parts`), so --steps counts zero1's updates and tokens.
A round computes at least `accum` halves, and keeps computing while its communication is in
flight, up to `max_accum` (faster workers contribute more; N is the all-reduced total);
`deterministic=True` computes exactly `accum`. The schedule counts updates, as the reference
code's LambdaLR does (docs/strategies.md says why not tokens). A rank that has closed serves
its peers' further rounds until one finds no rank computing (overlap.py); then the model gets
the real θ.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import UsageError
from ..engines.flat import ShardedOptions
from ..contract.options import option
from ..contract.parts import LOCAL, attributes
from ..engines.overlap import OverlappedStrategy
from ..engines.costs_sharded import AccoCost, two_rounds
from .registry import register


@dataclass
class AccoOptions(ShardedOptions):
    deterministic: bool = option(False, "exactly --accum micro-batches per round, whatever the timing")
    max_accum: int = option(0, "most micro-batches per round while communicating (0: 4 x --accum)", min=0)

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        self.rounds_bound(cfg.accum)
        # The CLI's loader halves --micro-batch; wrap()'s RunShape has none (the user's loop feeds
        # its own micro-batches, each a round's, as they come).
        if getattr(cfg, "micro_batch", 0) % ACCO.micro_batch_parts:
            raise UsageError(f"--micro-batch {cfg.micro_batch} is odd: acco computes each micro-batch in two "
                             f"halves, one in its estimate round and one in its real round (give an even size)")

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
    micro_batch_parts = 2          # a step's batch in two halves: the estimate round's, the real round's
    inside_replica = ("ddp", "fsdp")  # across replica groups: on the tensors each position owns (fsdp: its shards)
    cost = AccoCost                # two overlapped rounds a step, adaptive; the start-up micro-batch

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deterministic = self.options.deterministic
        self.max_accum = self.options.rounds_bound(self.accum)
        self.starting = True           # the start-up micro-batch at θ_0 comes first
        self.estimate_next = True      # the first round is an estimate round
        self.holds_estimate = False    # does the model hold θ̃ rather than θ?
        self.local_count = 0           # micro-batches summed in G
        self.round_micro = 0           # micro-batches computed in the round now in flight
        self.real_rounds = 0
        self.lr = float("nan")

    @classmethod
    def comm_plan(cls, layout, world, options):
        return two_rounds(super().comm_plan(layout, world, options))

    def state_parts(self):
        """ZeRO-1's and B (overlap.py), G's count this worker's own (a joiner's first round votes none,
        as a closed rank's; it contributes from its next), the round bookkeeping replicated."""
        return {**super().state_parts(), **attributes(self, "local_count", kind=LOCAL),
                **attributes(self, "starting", "estimate_next", "holds_estimate", "round_micro", "real_rounds", "lr")}

    def begin_step(self, ctx):
        if self.starting:  # G must hold ∇θ_0 before the first round can start
            self.flat.zero_grad()
        else:
            self.start_round()  # a step begins with its estimate round

    def start_round(self):
        estimate = self.estimate_next
        if estimate:  # the estimate and the real round that follows share one lr
            self.lr = self.set_lr(self.real_rounds)
        self.launch(estimate)
        self.round_micro = 0
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
            return False
        self.local_count += 1
        self.round_micro += 1
        # Keep computing while the round is in flight: at least accum, at most max_accum.
        if self.round_micro < self.accum or (not self.deterministic and self.round_micro < self.max_accum
                                             and self.round_in_flight()):
            return False
        return self.land(ctx) is True

    def serve_step(self):
        """Closed: the next step's rounds as the loop would take them, with no new micro-batch
        (an estimate round still sends the gradients G holds; G is zeroed when a real round
        starts); False once a round found no rank computing."""
        if self.starting:  # closed before the start-up micro-batch: the start-up with none
            self.starting = False
            self.flat.zero_grad()
            self.load_round(0)
        if not self.rounds.engine.pending:
            self.start_round()
        while (landed := self.land(None)) is False:  # the estimate round landed: on to the real one
            pass
        return landed is True

    def land(self, ctx) -> bool | None:
        """Land the round in flight. True: it was the real round, θ_{t+1} is in the model and
        the step is done; False: the estimate round, and the step's real round has started at θ̃
        (shared inside the replica first); None: no rank computed in it, the run is over."""
        was_estimate = self.estimate_next
        if not self.end_round(ctx):
            return None
        if not was_estimate:
            return True
        self.share_inside()  # across replica groups: θ̃ everywhere before the real round computes at it
        self.start_round()
        return False

    def settle(self):
        """After the last round the model gets the real θ (an estimate round's θ̃ is not kept)."""
        if self.holds_estimate:
            self.flat.params.copy_(self.comm.meta_all_gather(self.shard_opt.own_params()).view(-1))
            self.holds_estimate = False
            self.share_inside(counted=False)  # bookkeeping, as the gather above

    def end_round(self, ctx):
        """Land the round in flight; False when no rank computed in it (the run is over)."""
        self.rounds.wait()
        if self.rounds.ended:
            return False
        if self.rounds.skipped and ctx is not None:  # G may still hold the bad gradient: the next real round zeroes it
            ctx.skip()
        estimate = self.estimate_next
        if not estimate:
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

    def report(self) -> dict:
        return {"rounds": 2 * self.real_rounds, "real_rounds": self.real_rounds,
                "optimizer_steps": self.real_rounds, "deterministic": self.deterministic,
                "max_accum": self.max_accum, "extra_memory_bytes_vs_zero1": self.extra_memory_bytes()}

"""DiLoCo (Douillard et al., arXiv 2311.08105): local inner steps, a rare outer step.

    every worker starts from the global θ
    H inner steps of the inner optimizer (AdamW by default; its state stays local, never sent)
    Δ_r = θ_global − θ_r;   Δ = mean_r Δ_r                       (the only communication)
    θ_global ← outer SGD(θ_global, grad = Δ)   Nesterov momentum 0.9, lr 0.7 (paper defaults)
    every worker resets to θ_global

`--steps` counts inner steps (one trainer step = one inner step of `--accum` micro-batches),
so equal --steps means equal tokens with ddp. A run that ends mid-period syncs once more at
its last step (or when closed), so the saved model is θ_global; evaluation sees θ_global.
The syncs are the outer-sync engine's (outer_sync.py, shared with Streaming DiLoCo and
SparseLoCo); beyond the paper, Δ may travel in bf16, int8/int4 or a compressor SPEC with
error feedback (outer_wire.py), phases may fit each worker's speed (sync_by_time.py), and the
outer step may come a period late (--outer-delay 1, PCCL's async DiLoCo), each worker's own Δ_r
standing in for its share of the mean in flight (--eager, Kale et al.'s eager updates: eager.py),
after a warm-up whose syncs still wait for their mean (--outer-delay-warmup, as DiLoCo's own runs
start from a synchronously trained model).

Under --elastic (contract/elastic.py) the commit points are the outer syncs, where every member
holds θ_global and the outer momentum alike: that is the state a joiner receives, as a torchft
DiLoCo fragment registers exactly its global parameters and outer optimizer. The rest is each
worker's own, and a joiner starts it as a fresh worker at step 0 did -- its local θ at θ_global,
no error-feedback residual for --outer-compress (zero) and nothing trained since the sync --
but for its inner optimizer, whose moments it copies from its donor, as torchft's DiLoCo
example heals model, inner and outer optimizer from a peer (`from_donor`: a fresh AdamW's
first steps are sign steps, each joiner's first pseudo-gradient inflated into the outer step). The merge is token-weighted, so a
joiner counts for what it trained.
With --outer-delay 1 a mean is in flight at every commit point; the commit does not wait for it
(that would expose what the delay hides). Each member keeps its own part of it (its Δ_r, as the
wire carries it, and its tokens) as local state, and a run that loads the state sends the part
again at its next step, on its own group: after a member is lost the survivors roll back and
re-issue the reduction among themselves, token-weighted, the dead member's part lost with it; a
joiner's part is a fresh worker's (no Δ, no tokens), so it contributes nothing to a mean already
in flight. --eager's stand-in (offset, share standing in, the offset's momentum) is local too: a
joiner starts with none, from θ_global.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..engines import outer_sync
from ..contract.base import Strategy
from ..contract.context import all_finite
from ..contract.options import Options, option
from ..engines.outer_wire import PRECISIONS, WireFormat
from .registry import register
from ..engines.token_weights import WEIGHTS, contribution


def outer_step_suffix(outer_delay: int, eager: bool) -> str:
    """How a plan or a report names the outer step: ' eager', ' delayed' (one period late) or ''."""
    return " eager" if eager else " delayed" if outer_delay else ""


@dataclass
class DiLoCoOptions(Options):
    """The local-SGD family's options (Streaming DiLoCo and SparseLoCo share the flags)."""
    sync_every: int = option(32, "inner steps (trainer steps) between outer syncs, H", min=1)
    outer_lr: float = option(0.7, "outer SGD learning rate", above=0)
    outer_momentum: float = option(0.9, "outer SGD momentum", min=0, max=1)
    outer_nesterov: bool = option(True, "Nesterov momentum in the outer SGD (only when momentum > 0)")
    outer_precision: str = option("fp32", "outer gradients on the wire: fp32, bf16, or int8/int4 "
                                  "(blockwise absmax, all-gathered)", choices=tuple(PRECISIONS))
    sync_by: str = option("steps", "inner phase length: 'steps' (H inner steps) or 'time' (as many as fit "
                          "in a 1x worker's H steps; FedNova averaging)", choices=("steps", "time"))
    outer_compress: str = option("none", "outer gradients through a lowcomm.compress SPEC with error feedback, "
                                 "all-gathered: topk:F|K, chunk:N, bits:B, quant:absmax|stat (e.g. topk:0.02,bits:2)")
    outer_ef_decay: float = option(1.0, "--outer-compress error feedback: e <- decay*e + delta before "
                                   "compressing (1: classic, 0: no error feedback)", min=0, max=1)
    outer_weights: str = option("equal", "outer gradients averaged with equal weights, or weighted by the tokens "
                                "each worker trained since the last sync (Decoupled DiLoCo; --elastic uses tokens)",
                                choices=WEIGHTS)
    outer_delay: int = option(0, "outer steps a sync's mean is applied late: 0 waits for it; 1 reduces period t's "
                              "during period t+1 and applies it at t+1's end (PCCL's async DiLoCo)", min=0, max=1)
    eager: bool = option(False, "with --outer-delay 1: each worker's own pseudo-gradient stands in for its share of "
                         "the mean in flight until that mean lands (Kale et al.'s eager updates)")
    outer_delay_warmup: int = option(0, "with --outer-delay 1: the syncs of the first N trainer steps still wait "
                                     "for their mean (a synchronous start); later ones are a period late", min=0)

    def check(self) -> None:
        self.wire().check()
        if self.eager and not self.outer_delay:
            raise UsageError("--eager needs --outer-delay 1: the worker's own pseudo-gradient stands in for a mean "
                             "in flight, and with --outer-delay 0 none is")
        if self.outer_delay_warmup and not self.outer_delay:
            raise UsageError(f"--outer-delay-warmup {self.outer_delay_warmup} needs --outer-delay 1: with --outer-delay "
                             f"0 every sync waits for its mean already")
        if self.eager and self.sync_by == "time":
            raise UsageError("--eager does not run with --sync-by time: a worker's share of a FedNova mean is known "
                             "only when the mean lands")
        if self.sync_by == "time" and self.outer_weights == "tokens":
            raise UsageError("--outer-weights tokens does not run with --sync-by time, whose FedNova averaging "
                             "already weights each worker by its inner steps")

    def check_run(self, cfg) -> None:
        if self.sync_by == "time" and (cfg.replicas or cfg.workers) < cfg.workers:
            raise UsageError(f"--sync-by time does not run across replica groups (--replicas {cfg.replicas}) yet")

    def check_length(self, steps: int) -> None:
        if self.outer_delay_warmup and self.first_late_sync() >= steps:
            raise UsageError(f"--outer-delay-warmup {self.outer_delay_warmup} leaves no sync of --steps {steps} a "
                             f"period late (the first after it would be at step {self.first_late_sync()}, and the "
                             f"run's final sync waits for its mean): drop --outer-delay 1 for a synchronous run, or "
                             f"shorten the warm-up")

    def first_late_sync(self) -> int:
        """The first trainer step past the warm-up at which some fragment's sync is issued: the
        first mean a period late, unless it is the run's final sync (which waits for it)."""
        start, every, fragments = self.outer_delay_warmup + 1, self.sync_every, self.streaming()[0]
        return min(start + (outer_sync.sync_offset(f, every, fragments) - start) % every for f in range(fragments))

    def run_note(self, cfg) -> str | None:
        if not (self.outer_delay and self.outer_momentum > 0) or self.first_late_sync() >= cfg.steps:
            return None  # (the latter: a run too short for a regular sync; no mean is late)
        if self.eager:
            return (f"--eager with outer momentum {self.outer_momentum:g}: measured here, eager updates learned more "
                    f"with --outer-momentum 0 (docs/strategies.md)")
        return (f"--outer-delay 1 with outer momentum {self.outer_momentum:g}: a mean a period stale through "
                f"momentum overshoots; PCCL's async DiLoCo runs it with --outer-momentum 0 (docs/strategies.md)")

    def wire(self) -> WireFormat:
        return WireFormat(self.outer_precision, self.outer_compress, self.outer_ef_decay, self.outer_weights)

    def streaming(self) -> tuple[int, int, float]:
        """(fragments F, merge delay τ, merge weight α): one, none, θ_global (Streaming DiLoCo's vary)."""
        return 1, 0, 0.0

    def delayed_at(self, t: int) -> bool:
        """Is the sync at trainer step t (from 1) a period late: --outer-delay 1, past the warm-up?"""
        return bool(self.outer_delay) and t > self.outer_delay_warmup

    def hidden_steps(self) -> int:
        """Inner steps whose compute a sync's reduction runs behind before it is waited for."""
        return self.sync_every if self.outer_delay else self.streaming()[1]

    def merge_delay(self) -> int:
        """Trainer steps from a fragment's sync to its merge (its commit point under --elastic):
        τ, or none with --outer-delay 1, whose syncs merge the mean of the period before at once."""
        return 0 if self.outer_delay else self.streaming()[1]


@register("diloco")
class DiLoCo(Strategy):
    Options = DiLoCoOptions
    reproducible_options = {"sync_by": "steps"}
    inside_replica = ("ddp", "fsdp")  # the inner phase inside a replica, pseudo-gradients synced across (comm = cross)

    @classmethod
    def model_state_bytes(cls, num_params, world, options):  # θ, ∇θ, moments, θ_global, momentum (+ residual)
        # (+ --eager's offset, the share standing in and the offset's momentum)
        return (24 + 4 * (options.outer_compress != "none") + 12 * options.eager) * num_params

    @classmethod
    def plan_label(cls, options):
        return f"{cls.name} H={options.sync_every}" + outer_step_suffix(options.outer_delay, options.eager)

    @classmethod
    def comm_plan(cls, layout, world, options):
        sizes = layout.fragment_sizes(options.streaming()[0])
        return outer_sync.comm_plan(sizes, world, options.sync_every, options.wire(), options.sync_by == "time")

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        return outer_sync.plan_occurrences(op, steps)

    @classmethod
    def exposed_comm_s(cls, plan, cost, options):
        # A sync's reduction runs behind the inner steps until it is waited for: τ of them
        # (streaming), a whole period with --outer-delay 1 (but for the warm-up's syncs, which
        # wait in full), none otherwise; the final one behind none.
        return outer_sync.exposed_s(plan, lambda op: cost.price(op.collective, op.nbytes),
                                    lambda op: cls.plan_rate(op, options, cost.steps),
                                    options.hidden_steps() * cost.compute_s, cost.steps,
                                    options.outer_delay_warmup if options.outer_delay else 0)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        o = self.options
        fragments, delay, self.alpha = o.streaming()
        self.inner = self.make_optimizer(self.params)
        self.sync = outer_sync.OuterSync(self.params, self.layout.fragments(fragments), self.comm,
                                         o.sync_every, o.wire(), timed=o.sync_by == "time", delay=delay,
                                         eager_outer=self._outer_sgd if o.eager else None)
        self.outer = self._outer_sgd(self.sync.globals)
        self.inner_steps, self.last_loss = 0, float("nan")
        self.min_contributors = 1  # --outer-weights tokens: an outer step needs this many workers that trained

    def _outer_sgd(self, params):
        o = self.options
        return torch.optim.SGD(params, lr=o.outer_lr, momentum=o.outer_momentum,
                               nesterov=o.outer_nesterov and o.outer_momentum > 0)

    # --elastic (the module docstring): the worker's own parts; θ_global, the outer momentum and the
    # syncs' schedule are replicated.
    local_state = ("model", "optimizers.0.state", "optimizers.2.state", "extra.since", "extra.tokens",
                   "extra.outer_residuals", "extra.in_flight", "extra.stand_in")
    # A joiner's inner AdamW: its donor's moments, as torchft's DiLoCo heals the inner optimizer.
    # Fresh, its first inner steps were sign steps (a full lr on every coordinate, several times a
    # settled step): each joiner's first pseudo-gradient was inflated into the outer momentum, and
    # a faulted streaming_diloco run's training loss drifted above the fault-free run's join by join.
    from_donor = ("optimizers.0.state",)

    @classmethod
    def commits_at(cls, options, step):
        return outer_sync.merges_at(step, options.sync_every, options.streaming()[0], options.merge_delay())

    @classmethod
    def redoes_last_step(cls, options):
        # before a commit's step no merge is pending (τ = 0, or --outer-delay 1: a mean in flight
        # is kept as each member's part and re-issued); H = 1 commits every step anyway
        return options.merge_delay() == 0 and options.sync_every > 1

    @classmethod
    def elastic_refusal(cls, options, across_replicas):
        if options.sync_by != "steps":
            return ("it needs --sync-by steps: its commit points are the outer syncs, which must fall on the "
                    "same step on every worker")
        return None

    @classmethod
    def elastic_options(cls, options):
        # members come and go: each counts for the tokens it trained since the last sync
        return dataclasses.replace(options, outer_weights="tokens")

    def require_contributors(self, n):
        self.min_contributors = n

    @classmethod
    def fresh_local(cls, path, value):
        return value if path == "model" else super().fresh_local(path, value)  # θ_global: join_from_peer

    def join_from_peer(self):
        self.sync.restart_from_globals()

    def begin_step(self, ctx):
        self.sync.reissue()  # a loaded state's reduction in flight goes out again, on this group
        ctx.lr = self.set_lr(ctx.step, [self.inner])
        # --sync-by time: a slot without an inner step for this rank (pull-style only; syncs still run)
        if ctx.pull and not self.sync.steps_this_slot():
            self._end_of_slot(ctx)
            ctx.end_idle(self.last_loss)  # the rank's latest inner loss, not a fake 0

    def update(self, ctx):
        self.reduce_inside()  # across replica groups: the replica's mean gradient, one inner step
        # Inner steps are local: a non-finite loss or gradient skips this rank's (replica's) inner step only.
        bad = ctx.poison_nonfinite(*(p.grad for p in self.params if p.grad is not None))
        ctx.skip() if bad else self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.inner_steps, self.last_loss = self.inner_steps + 1, ctx.mean_loss
        self.sync.inner_step(time.perf_counter() - ctx.t0, 0 if bad else ctx.tokens)  # a skipped step trained none
        self._end_of_slot(ctx)

    def _end_of_slot(self, ctx) -> None:
        t = self.steps_done + 1  # this trainer step, counted from 1
        self.sync.end_slot(t, ctx.t0)
        if t == self.total_steps:
            return self.finish(1, ctx)
        if self.options.delayed_at(t):
            return self._sync_late(ctx, t)
        if self.options.outer_delay:  # a warm-up sync: waited for at once, nothing left in flight
            self.sync.issue_due(t, delay=0)
            return self._land(ctx, t, 0.0)
        self._land(ctx, t, self.alpha)  # syncs issued `delay` steps ago
        self.sync.issue_due(t)
        self._land(ctx, t, self.alpha)  # delay 0: at once

    def _sync_late(self, ctx, t: int) -> None:
        """--outer-delay 1, as PCCL's async DiLoCo runs it (and Kale et al.'s delayed outer
        gradients): at a fragment's sync this period's Δ is issued against the θ_global the
        period started from, the mean issued a period ago (reduced behind this period's inner
        steps) takes its outer step, and the next period starts from the new θ_global. The
        first two periods start from θ_0; every mean is applied one outer step late.
        --eager (Kale et al.'s eager updates): Δ_r/W stands in for this worker's share of the
        mean just issued, in place of its share of the one that landed (engines/eager.py), and
        the next period starts from θ_global plus this worker's stand-in offset."""
        for i in self.sync.due(t):
            previous = self.sync.take_previous(i)  # Δ̄ of the period before (its wait: all that is exposed)
            mine = self.sync.issue(i, t + self.sync.every)  # this period's Δ_r, reduced behind the next
            if previous is not None:
                self._outer_step(ctx, i, previous)  # θ_global ← OuterSGD(θ_global, Δ̄)
            if self.sync.stand_in is not None:  # --eager: Δ_r/W stands in for this rank's share of the new mean
                self.sync.stand_in.replace(i, mine / self.comm.world)
            self.sync.merge(i, 0.0, steps=int(previous is not None), settled=False)

    def _land(self, ctx, t: int | None, alpha: float) -> None:  # merges due at step t (None: all)
        for i in self.sync.merges_due(t):
            self._collect(ctx, i)
            self.sync.merge(i, alpha)

    def _collect(self, ctx=None, *fragments: int) -> None:
        """Wait for the reductions in flight (of `fragments`, else all); outer step on each
        (--outer-delay 1 past its warm-up: each mean is kept for its step, one period after it was issued)."""
        if self.options.delayed_at(self.steps_done + 1):
            return self.sync.drain(*fragments)
        for i, delta in self.sync.wait(*fragments):
            self._outer_step(ctx, i, delta)

    def _outer_step(self, ctx, i: int, delta) -> None:
        if not self.quorate():  # too few trained: θ_global stays, every rank resets to it
            return
        if all_finite(delta):  # the same Δ on every rank: all keep θ_global alike
            self.sync.globals[i].grad = delta
            self.outer.step()
            self.sync.globals[i].grad = None
        elif ctx is not None:
            ctx.skip()

    def quorate(self) -> bool:
        """Did enough workers train since the last sync (tokens > 0)? Always with equal weights."""
        info = self.contribution()
        return info is None or info["contributors"] >= self.min_contributors

    def contribution(self) -> dict | None:
        """The last outer sync's workers that contributed and their tokens (--outer-weights tokens)."""
        return contribution(self.sync.wire.last_tokens)

    def rounds_started(self) -> int:  # 1 while a sync is owed: the driver takes the most over the ranks
        return int(self.sync.owed())

    def finish(self, rounds: int, ctx=None) -> None:
        """The final sync (at the last step, or at close while one is owed): all end on θ_global."""
        if rounds and self.options.outer_delay:  # the last period's Δ against its base, then both means
            previous = {i: self.sync.take_previous(i) for i in range(len(self.sync.fragments))}
            self.sync.issue_all()
            for i, delta in previous.items():
                if delta is not None:
                    self._outer_step(ctx, i, delta)
            for i, delta in self.sync.wait():
                self._outer_step(ctx, i, delta)
                if self.sync.stand_in is not None:  # every mean has landed: no share stands in
                    self.sync.stand_in.withdraw(i)
                self.sync.merge(i, 0.0, steps=1 + (previous[i] is not None))
        elif rounds:
            self._land(ctx, None, self.alpha)
            self.sync.issue_all()
            self._land(ctx, None, 0.0)
        return bool(rounds)

    def use_comm(self, comm) -> None:
        self._collect()  # what is in flight lands on the group it was issued on
        super().use_comm(comm)
        self.sync.use_comm(comm)

    def release(self) -> None:
        self.sync.release()  # nothing left unwaited

    @contextmanager
    def swapped_for_eval(self):
        if not self.options.outer_delay:  # delayed: θ_global waits for no mean in flight
            self._collect()
        with self.sync.globals_in_model():
            yield self.model

    def optimizers(self):
        stand_in = self.sync.stand_in
        return [self.inner, self.outer] + ([stand_in.outer] if stand_in is not None else [])

    def extra_state(self) -> dict:
        if not self.options.outer_delay:
            self._collect()  # a sync in flight lands first: its outer step is part of the state
        # --outer-delay 1: a mean in flight stays in flight, kept as this rank's part of it and
        # re-issued when the state is loaded (on the group of the run that loads it)
        return {**self.sync.state_dict(), "inner_steps": self.inner_steps, "last_loss": self.last_loss}

    def load_extra_state(self, sd: dict) -> None:
        self.sync.load_state_dict(sd)
        self.inner_steps, self.last_loss = sd["inner_steps"], sd["last_loss"]

    def report(self) -> dict:
        o = self.options
        return {**self.sync.report(self.steps_done), "inner_steps_rank0": self.inner_steps, "sync_every": o.sync_every,
                "inner_steps_per_step_rank0": self.inner_steps / max(self.steps_done, 1), "sync_by": o.sync_by,
                "outer_precision": o.outer_precision, "outer_compress": o.outer_compress}

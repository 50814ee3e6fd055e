"""DiLoCo (Douillard et al., arXiv 2311.08105), and the outer-sync machinery Streaming DiLoCo shares.

    every worker starts from the global θ
    H inner steps of the inner optimizer (AdamW by default; its state stays local, never sent)
    Δ_r = θ_global − θ_r;   Δ = mean_r Δ_r                       (the only communication)
    θ_global ← outer SGD(θ_global, grad = Δ)   Nesterov momentum 0.9, lr 0.7 (paper defaults)
    every worker resets to θ_global

`--steps` counts inner steps (trainer step = one inner step of `--accum`
micro-batches), so equal --steps means equal tokens with ddp. A run that
ends mid-period (the trainer sets `total_steps`) does one last sync at its
final step, so the saved and evaluated model is the global one. Validation
always evaluates θ_global (swapped in for the evaluation, local θ put back).

Wire formats of Δ (`--outer-precision`):
  fp32, bf16   one all_reduce (sum) of w_r·Δ_r in that precision
  int8, int4   blockwise-absmax quantized (lowcomm.compress.IntQuantizer, blocks of
               64 values, fp32 scale each, bit-packed). A ring all-reduce cannot sum
               packed integers, so every rank all_gathers every rank's packed
               payload (values + fp32 scales + 16 bytes of step info) and sums
               the dequantized values locally in rank order (every rank gets
               the same bits): (W−1)·s bytes per rank for a payload of s bytes.
`--outer-compress SPEC` (instead of --outer-precision): any lowcomm.compress compressor
(e.g. topk:0.02,bits:2), with error feedback on Δ_r (residual per fragment, in the state):
    e_r ← β·e_r + Δ_r;   send C(e_r);   e_r ← e_r − decode(C(e_r))     (β: --outer-ef-decay)
all_gathered like int8/int4 (payload + step info); every rank decodes every payload and
averages in rank order; a value only some ranks sent (top-k) is averaged over the ranks that
sent it, as DeMo and SparseLoCo decode (Compressor.combine). Then the usual outer step.

`--sync-by time` (inner phases sized to speed). A trainer step is then one
*slot*: the time a 1x worker takes for one inner step. A rank does at most
one inner step per slot; the fastest rank does one in every slot, a rank k×
slower about one in k (its other slots are empty trainer steps that return
at once with 0 micro-batches). So --steps counts slots: the same --steps and
--sync-every mean the same wall time for every rank, and the fastest rank
sees the tokens it would see under --sync-by steps. Syncs stay at fixed
slots (every H trainer steps), so ranks never need a collective to agree
*when* to sync; how many inner steps a rank fits is decided locally, by a
deadline in its own time: it steps in a slot when, by its own mean cost per
inner step c_r (data, forward/backward with the emulated slowdown, inner
optimizer step), the step ends (to the half) within the 1x schedule's time at
the end of that slot, i.e. own_time + c_r/2 <= schedule + c_ref, where own
time sums only this rank's slots (not evaluations or log gathers) and the
schedule adds c_ref, the fastest rank's mean cost, per slot. This corrects
itself: a step that ran long makes the next slots empty. The costs ride
along each sync (16 bytes per rank: an all_gather before the all-reduce, or
inside the quantized payload), plus one calibration all_gather after trainer
step 2 (step 1 pays one-off set-up costs), so the first period is sized too.
Pseudo-gradients of ranks that ran
τ_r inner steps are combined by FedNova's normalized averaging (Wang et al.
2020, vanilla-SGD form with p_r = 1/W): Δ = τ_eff · Σ_r (1/W) Δ_r/τ_r with
τ_eff = mean_r τ_r, which is the plain mean when all τ_r are equal. The
trainer's log gathers (`--log-every`) and evaluations are sync points too:
with a slow rank, set `--log-every` to a multiple of H so they coincide with
outer syncs. Push-style users (`backward()`) always get an inner step per
trainer step (empty slots exist only in the pull-style `step()`).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..compress import Compressor, ErrorFeedback, IntQuantizer, parse_spec
from ..errors import UsageError
from ..models.layout import ModelLayout
from .base import Strategy
from .context import all_finite
from .options import Options, option
from .plan import PlannedOp
from .registry import register

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": 8, "int4": 4}
INFO_BYTES = 16  # float64 (τ_r, c_r) per rank
OUTER_BLOCK = 64  # values per quantization scale of an outer gradient


def outer_quantizer(bits: int) -> IntQuantizer:
    return IntQuantizer(bits, OUTER_BLOCK)


def outer_compressor(options) -> Compressor | None:
    """What a rank all-gathers in place of the all-reduce: --outer-compress's compressor, or
    --outer-precision int8/int4's; None for an fp32/bf16 all-reduce."""
    if options.outer_compress != "none":
        return parse_spec(options.outer_compress)
    prec = PRECISIONS[options.outer_precision]
    return outer_quantizer(prec) if isinstance(prec, int) else None


CALIBRATION = "calibration: step times after trainer step 2 (--sync-by time)"


@dataclass
class OuterOptions(Options):
    """Options shared by diloco and streaming_diloco (same flags, same TOML keys)."""
    sync_every: int = option(32, "inner steps (trainer steps) between outer syncs, H", min=1)
    outer_lr: float = option(0.7, "outer SGD learning rate", above=0)
    outer_momentum: float = option(0.9, "outer SGD momentum", min=0, max=1)
    outer_nesterov: bool = option(True, "Nesterov momentum in the outer SGD (only when momentum > 0)")
    outer_precision: str = option("fp32", "outer gradients on the wire: fp32, bf16, or int8/int4 "
                                  "(blockwise absmax, all-gathered)", choices=tuple(PRECISIONS))
    sync_by: str = option("steps", "inner phase length: 'steps' (H inner steps) or 'time' (as many as fit "
                          "in a 1x worker's H steps; FedNova averaging)", choices=("steps", "time"))
    outer_compress: str = option("none", "outer gradients through a lowcomm.compress SPEC with error "
                                 "feedback, all-gathered, e.g. topk:0.02,bits:2 or int4,block:64 "
                                 "(topk:F|K, chunk:N, bits:B, quant:absmax|stat; none: off)")
    outer_ef_decay: float = option(1.0, "--outer-compress error feedback: e <- decay*e + delta before "
                                   "compressing (1: classic, 0: no error feedback)", min=0, max=1)

    def check(self) -> None:
        if self.outer_compress == "none":
            return
        try:
            parse_spec(self.outer_compress)
        except ValueError as e:
            raise UsageError(f"--outer-compress: {e}") from None
        if self.outer_precision != "fp32":
            raise UsageError(f"--outer-compress ({self.outer_compress}) and --outer-precision "
                             f"({self.outer_precision}) both set the wire format: give one")


@dataclass
class DiLoCoOptions(OuterOptions):
    pass


def fednova_weights(taus: torch.Tensor) -> torch.Tensor:
    """w_r with Δ = Σ_r w_r Δ_r: τ_eff / (W' τ_r) over the W' ranks that stepped (τ_r > 0)."""
    taus = taus.double()
    active = taus > 0
    if not bool(active.any()):
        return torch.zeros_like(taus)
    tau_eff = taus[active].mean()
    return torch.where(active, tau_eff / (int(active.sum()) * taus.clamp(min=1)), torch.zeros_like(taus))


class OuterSync(Strategy):
    """Local inner steps, fragment-wise outer syncs (diloco: one fragment, no delay)."""

    Options = DiLoCoOptions
    reproducible_options = {"sync_by": "steps"}

    @classmethod
    def model_state_bytes(cls, num_params, world, options):
        # θ, ∇θ and the inner AdamW's moments, plus the fp32 global copy and the outer
        # SGD's momentum (and an error-feedback residual when outer gradients are compressed)
        return 24 * num_params + (4 * num_params if getattr(options, "outer_compress", "none") != "none" else 0)

    def __init__(self, model, comm, make_optimizer, *args, **kwargs):
        super().__init__(model, comm, make_optimizer, *args, **kwargs)
        o = self.options
        self.H = o.sync_every
        self.time_mode = o.sync_by == "time"
        self.precision = PRECISIONS[o.outer_precision]
        self.compressor = outer_compressor(o)
        # Error feedback only for --outer-compress (int8/int4 --outer-precision never had it).
        use_ef = o.outer_compress != "none" and o.outer_ef_decay > 0
        self.ef = ErrorFeedback(self.compressor, enabled=use_ef, decay=o.outer_ef_decay) \
            if self.compressor is not None else None
        self.compress_s = 0.0  # CPU time spent compressing and decoding outer gradients
        self.inner = make_optimizer(self.params)
        # (fragment index f, its parameters), empty fragments dropped.
        self.fragments = [(f, ps) for f, ps in enumerate(self.fragment_params()) if ps]
        self.globals = [nn.Parameter(self._flat(ps).float().clone(), requires_grad=False)
                        for _, ps in self.fragments]
        o_m = o.outer_momentum
        self.outer = torch.optim.SGD(self.globals, lr=o.outer_lr, momentum=o_m,
                                     nesterov=o.outer_nesterov and o_m > 0)
        n = len(self.fragments)
        self.since = [0] * n          # inner steps since fragment i's last sync (τ_r)
        self.pending: dict[int, int] = {}       # fragment i -> trainer step its merge is due
        self.landed: dict[int, torch.Tensor] = {}  # fragment i -> gathered (τ, c) of its landed sync
        # --sync-by time: this rank's own time in its slots, and the 1x schedule's
        self.own_s, self.sched_s = 0.0, 0.0
        self.c_ref, self.c_mine, self.is_ref = 0.0, 0.0, True
        self.costs: list[float] = []              # seconds of each inner step since the last exchange
        self.inner_steps = 0
        self.syncs = 0                            # fragment syncs done (diloco: outer steps)
        self.last_loss = float("nan")
        self._ctx = None  # the step in progress (a sync that sees a non-finite Δ marks it skipped)

    # -- layout ------------------------------------------------------------------
    def fragment_params(self) -> list[list[nn.Parameter]]:
        return [self.params]

    @staticmethod
    def _flat(params) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in params])

    @staticmethod
    def _write(params, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_(flat[offset:offset + n].view_as(p))
                offset += n

    # -- plan --------------------------------------------------------------------
    @classmethod
    def fragment_numels(cls, layout: ModelLayout, options) -> list[int]:
        return [layout.numel]

    @classmethod
    def fragment_count(cls, options) -> int:
        return 1

    @classmethod
    def sync_op(cls, numel: int, world: int, options, every: int, offset: int, f: int) -> PlannedOp:
        comp = outer_compressor(options)
        if comp is not None:
            s = comp.nbytes(numel) + INFO_BYTES
            return PlannedOp("all_gather", world * s, every, offset,
                             what=f"fragment {f}: {comp.name} outer gradient + step info, every rank's")
        prec = PRECISIONS[options.outer_precision]
        itemsize = torch.empty((), dtype=prec).element_size()
        return PlannedOp("all_reduce", numel * itemsize, every, offset,
                         what=f"fragment {f}: {options.outer_precision} outer gradient")

    @classmethod
    def comm_plan(cls, layout, world, options):
        H, F = options.sync_every, cls.fragment_count(options)
        plan = []
        for f, numel in enumerate(cls.fragment_numels(layout, options)):
            if numel == 0:
                continue
            offset = (f * H) // F
            plan.append(cls.sync_op(numel, world, options, H, offset, f))
            if options.sync_by == "time" and outer_compressor(options) is None:
                plan.append(PlannedOp("all_gather", world * INFO_BYTES, H, offset,
                                      what=f"fragment {f}: inner steps and step time"))
        if options.sync_by == "time":
            plan.append(PlannedOp("all_gather", world * INFO_BYTES, every=1, offset=2, what=CALIBRATION))
        return plan

    @classmethod
    def plan_occurrences(cls, op, steps, options):
        if steps < 1:
            return 0
        if op.what == CALIBRATION:
            return 1 if steps >= 2 else 0
        # Regular syncs before the last step, then the final sync (every fragment) at it.
        return op.occurrences(steps - 1) + 1

    # -- the push-style core -------------------------------------------------------
    def begin_step(self, ctx):
        self._ctx = ctx
        ctx.lr = self.set_lr(ctx.step, [self.inner])
        # --sync-by time: a slot this rank has no inner step for is an empty trainer step
        # (0 micro-batches; syncs still run). Only pull-style: a user's backward() always steps.
        if self.time_mode and ctx.pull and not self._steps_this_slot():
            self._end_of_slot(ctx, did_step=False)
            ctx.end_idle(self.last_loss)  # the rank's latest inner loss, not a fake 0

    def update(self, ctx):
        # Inner steps are local: a non-finite loss or gradient skips this rank's inner step only.
        if ctx.poison_nonfinite(*(p.grad for p in self.params if p.grad is not None)):
            ctx.skip()
        else:
            self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self.inner_steps += 1
        # The slot's whole cost so far: data, compute (emulated slowdown included), inner step.
        self.costs.append(time.perf_counter() - ctx.t0)
        self.since = [s + 1 for s in self.since]
        self.last_loss = ctx.mean_loss
        self._end_of_slot(ctx, did_step=True)

    def _end_of_slot(self, ctx, did_step: bool) -> None:
        t = self.steps_done + 1  # this trainer step, counted from 1
        if self.time_mode:
            self.own_s += time.perf_counter() - ctx.t0
            self.sched_s += self.c_ref
            if t == 1:
                self.costs = []  # the first step pays one-off set-up costs: not a speed sample
            elif t == 2:  # calibration: size the rest of the first period already
                self._update_rate(self._gather_info(0, self._mean_compute()))
        if self.total_steps is not None and t == self.total_steps:
            self._final_sync()
            return
        self._merge_due(t)
        for i, (f, _) in enumerate(self.fragments):
            if self._due(f, t):
                self._start_sync(i, t)
        self._merge_due(t)

    def _due(self, f: int, t: int) -> bool:
        offset = (f * self.H) // self.fragment_count(self.options)
        first = offset if offset > 0 else self.H
        return t >= first and (t - offset) % self.H == 0

    # -- syncs -----------------------------------------------------------------------
    def _mean_compute(self) -> float:
        """This rank's mean cost of one inner step since the last exchange (the mean, not
        a median: the schedule must add up to the fast rank's real time); 0 when it took none."""
        c = sum(self.costs) / len(self.costs) if self.costs else 0.0
        self.costs = []
        if c > 0:
            self.c_mine = c
        return c

    def _steps_this_slot(self) -> bool:
        """--sync-by time: the reference (fastest) rank steps in every slot; another rank
        steps when the step, by its own mean cost, ends (to the half) within the 1x
        schedule's time at the end of this slot. Own time counts only this rank's slots
        (not evaluations or log gathers), so no clock is shared."""
        if self.is_ref or self.c_ref <= 0:
            return True
        return self.own_s + self.c_mine / 2 <= self.sched_s + self.c_ref

    def _gather_info(self, tau: int, c: float) -> torch.Tensor:
        info = torch.tensor([float(tau), c], dtype=torch.float64)
        out = torch.empty(self.comm.world * 2, dtype=torch.float64)
        self.comm.all_gather(out, info)
        return out.view(self.comm.world, 2)

    def _update_rate(self, infos: torch.Tensor | None) -> None:
        if infos is None or not self.time_mode:
            return
        c = infos[:, 1]
        mine = float(c[self.comm.rank])
        seen = c[c > 0]
        if seen.numel():
            self.c_ref = float(seen.min())
            self.is_ref = mine > 0 and int(torch.where(c > 0, c, torch.inf).argmin()) == self.comm.rank

    def _issue(self, i: int, delta: torch.Tensor, tau: int, c: float) -> tuple:
        """Start reducing fragment i's Δ_r (async collectives, issued on the calling -- the
        compute -- thread, so every rank issues them in the same order); `_complete` waits."""
        W = self.comm.world
        info = torch.tensor([float(tau), c], dtype=torch.float64)
        if self.compressor is not None:
            t0 = time.perf_counter()
            payload, _ = self.ef.compress(f"fragment{self.fragments[i][0]}", delta.reshape(-1))
            packed = self.compressor.to_bytes(payload)  # e.g. codes and scales, bit-packed
            self.compress_s += time.perf_counter() - t0
            payload = torch.cat([packed, info.view(torch.uint8)])
            every = torch.empty(W * payload.numel(), dtype=torch.uint8)
            handle = self.comm.all_gather(every, payload, async_op=True)
            return ("gathered", [handle], every, (packed.numel(), delta.numel()))
        handles, infos = [], None
        if self.time_mode:  # FedNova: every rank sends Δ_r/τ_r, the τ_r travel beside it
            infos = torch.empty(W * 2, dtype=torch.float64)
            handles.append(self.comm.all_gather(infos, info, async_op=True))
            scale = 1.0 / tau if tau > 0 else 0.0
        else:
            scale = 1.0 / W
        buf = (delta * scale).to(self.precision)
        handles.append(self.comm.all_reduce(buf, op="sum", async_op=True))
        return ("reduced", handles, buf, infos)

    def _complete(self, ticket: tuple):
        """Wait for `_issue`'s collectives -> (the combined Δ in fp32, every rank's (τ, c) or None)."""
        kind, handles, buf, extra = ticket
        for h in handles:
            h.wait()
        W = self.comm.world
        if kind == "gathered":
            nq, numel = extra
            every = buf.view(W, -1)
            infos = torch.stack([every[r, nq:].clone().view(torch.float64) for r in range(W)])
            weights = fednova_weights(infos[:, 0]) if self.time_mode else \
                torch.full((W,), 1.0 / W, dtype=torch.float64)
            # rank order: every rank combines the same values the same way
            t0 = time.perf_counter()
            payloads = [self.compressor.from_bytes(every[r, :nq], numel) for r in range(W)]
            total = self.compressor.combine(payloads, [float(w) for w in weights])
            self.compress_s += time.perf_counter() - t0
            return total, (infos if self.time_mode else None)
        total = buf.float()
        if extra is None:
            return total, None
        infos = extra.view(W, 2)
        taus = infos[:, 0]
        active = int((taus > 0).sum())
        # Δ = τ_eff · (1/W') Σ_r Δ_r/τ_r over the W' ranks that stepped
        factor = float(taus[taus > 0].mean()) / active if active else 0.0
        return total.mul_(factor), infos

    def _outer_step(self, i: int, avg: torch.Tensor) -> None:
        if not all_finite(avg):  # the same Δ on every rank: all keep θ_global alike
            if self._ctx is not None:
                self._ctx.skip()
            return
        g = self.globals[i]
        g.grad = avg
        self.outer.step()
        g.grad = None

    def _sync_job(self, i: int, delta: torch.Tensor, tau: int, c: float):
        """Fragment i's whole sync, blocking: reduce Δ, outer step; returns the (τ, c) infos."""
        avg, infos = self._complete(self._issue(i, delta, tau, c))
        self._outer_step(i, avg)
        return infos

    def _delta(self, i: int) -> torch.Tensor:
        return self.globals[i].detach() - self._flat(self.fragments[i][1]).float()

    def _start_sync(self, i: int, t: int) -> None:
        """Fragment i's regular sync at trainer step t (diloco: done at once)."""
        delta, tau, c = self._delta(i), self.since[i], self._mean_compute()
        self.since[i] = 0
        self._land(i, self._sync_job(i, delta, tau, c), alpha=0.0)

    def _land(self, i: int, infos, alpha: float) -> None:
        """A sync's result is in θ_global: merge it into the local copy, count it."""
        self._merge(i, alpha)
        self.syncs += 1
        self._update_rate(infos)

    def _merge(self, i: int, alpha: float) -> None:
        """θ_f,local ← α·θ_f,local + (1−α)·θ_f,global."""
        ps = self.fragments[i][1]
        g = self.globals[i].detach()
        if alpha == 0.0:
            self._write(ps, g)
        else:
            self._write(ps, alpha * self._flat(ps).float() + (1 - alpha) * g)

    def _merge_due(self, t: int | None) -> None:
        """Land the syncs whose merge is due at trainer step t (None: all of them)."""

    def _collect(self) -> None:
        """Wait for a sync in flight (streaming)."""

    def _final_sync(self) -> None:
        """The run's last step: every fragment syncs now (in-flight ones land first),
        and every worker ends on θ_global."""
        self._merge_due(None)
        c = self._mean_compute()
        for i in range(len(self.fragments)):
            delta, tau = self._delta(i), self.since[i]
            self.since[i] = 0
            self._land(i, self._sync_job(i, delta, tau, c), alpha=0.0)

    # -- evaluation, state, report -------------------------------------------------
    @contextmanager
    def swapped_for_eval(self):
        """Evaluate θ_global; the local θ goes back afterwards."""
        self._collect()
        local = self._flat(self.params).clone()
        for i, (_, ps) in enumerate(self.fragments):
            self._write(ps, self.globals[i].detach())
        try:
            yield self.model
        finally:
            self._write(self.params, local)

    def optimizers(self):
        return [self.inner, self.outer]

    def rounds_started(self) -> int:
        """1 while a sync is owed (inner steps since a fragment's last sync, or a merge pending):
        the driver takes the most over the ranks, so all of them do the final sync or none."""
        return int(any(self.since) or bool(self.pending))

    def finish(self, rounds: int) -> None:
        """A run that ends between syncs (no total_steps given) ends on θ_global all the same."""
        if rounds:
            self._final_sync()

    def extra_state(self) -> dict:
        self._collect()
        return {"globals": [g.detach().clone() for g in self.globals], "since": list(self.since),
                "pending": dict(self.pending), "landed": {i: v.clone() for i, v in self.landed.items()},
                "own_s": self.own_s, "sched_s": self.sched_s, "c_ref": self.c_ref, "c_mine": self.c_mine,
                "is_ref": self.is_ref, "costs": list(self.costs),
                "inner_steps": self.inner_steps, "syncs": self.syncs, "last_loss": self.last_loss,
                "outer_residuals": self.ef.state_dict() if self.ef else {}}

    def load_extra_state(self, sd: dict) -> None:
        for g, saved in zip(self.globals, sd["globals"], strict=True):
            g.data.copy_(saved)
        self.since = list(sd["since"])
        self.pending = dict(sd["pending"])
        self.landed = {i: v.clone() for i, v in sd["landed"].items()}
        for key in ("own_s", "sched_s", "c_ref", "c_mine", "is_ref", "costs", "inner_steps", "syncs", "last_loss"):
            setattr(self, key, sd[key])
        if self.ef is not None:
            self.ef.load_state_dict(sd.get("outer_residuals", {}))

    def sync_bytes(self) -> list[int]:
        """Wire bytes one rank sends for each fragment's sync (diloco: one)."""
        W = self.comm.world
        out = []
        for f, ps in self.fragments:
            numel = sum(p.numel() for p in ps)
            op = self.sync_op(numel, W, self.options, self.H, 0, f)
            extra = (PlannedOp("all_gather", W * INFO_BYTES).wire_bytes(W)
                     if self.time_mode and self.compressor is None else 0)
            out.append(op.wire_bytes(W) + extra)
        return out

    def report(self) -> dict:
        per_sync = self.sync_bytes()
        return {"outer_syncs": self.syncs, "inner_steps_rank0": self.inner_steps,
                "bytes_per_sync_per_rank": max(per_sync), "sync_every": self.H,
                "sync_by": self.options.sync_by, "inner_steps_per_step_rank0": self.inner_steps / max(self.steps_done, 1), "outer_precision": self.options.outer_precision,
                "outer_compress": self.options.outer_compress, "compress_s": self.compress_s,
                "compress_s_per_step": self.compress_s / max(self.steps_done, 1),
                "global_copy_bytes": sum(g.numel() * g.element_size() for g in self.globals)}


@register("diloco")
class DiLoCo(OuterSync):
    Options = DiLoCoOptions

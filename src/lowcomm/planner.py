"""`lowcomm plan`: an analytic model of one training step for every registered strategy.

For N parameters, T tokens per step (all workers), W workers, one emulated link per
worker (comm/link.py) and per-worker slowdowns f_r:

    compute_s   = max_r f_r * (T / W) * seconds_per_token       (6 N FLOPs per token / FLOP/s, or measured)
    exposed_s   = Strategy.exposed_comm_s(plan, StepCost(...))  (what the strategy declares it overlaps)
    step_s      = compute_s + overhead_s + exposed_s            (overhead_s: per-step work outside the
                                                                 forward/backward, measured by --calibrate)
    tokens/s    = T * micro_batches_per_step / accum / step_s   (adaptive acco computes more while it waits)
    bytes/token = W * sum_op wire_bytes(op) * rate(op) / T
    memory      = Strategy.model_state_bytes(N, W, options)

Every collective is priced by LinkModel.duration, the formula the emulator sleeps by,
and every strategy's traffic comes from its own comm_plan: nothing here knows what a
strategy sends or overlaps.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from .comm.link import LinkModel
from .strategies import get as get_strategy
from .strategies.options import Options
from .strategies.plan import StepCost


@dataclass
class Cluster:
    params: int                 # N
    workers: int                # W
    tokens_per_step: int        # T, all workers together
    seconds_per_token: float    # one 1x worker's forward+backward per token
    link: LinkModel | None = None
    slowdown: tuple = ()        # f_r per worker (empty: all 1)
    accum: int = 1              # micro-batches per step (ddp overlaps only the last one's backward)

    def price(self, collective: str, nbytes: int) -> float:
        return self.link.duration(collective, nbytes, self.workers) if self.link is not None else 0.0

    @property
    def slowest(self) -> float:
        return max(self.slowdown, default=1.0)


@dataclass
class Prediction:
    strategy: str
    label: str                  # the strategy with its period, e.g. "diloco H=64"
    step_s: float
    compute_s: float
    overhead_s: float
    exposed_comm_s: float
    comm_s: float               # collectives in flight per step, overlapped or not
    idle_s: float               # a worker's mean wait for the slowest one's compute
    wire_bytes_per_rank_per_step: float
    bytes_per_token: float
    model_state_bytes: int
    tokens_per_s: float
    tokens_per_step: float = 0.0  # T, or more for a strategy that computes while it waits (adaptive acco)
    tokens_to_target: float | None = None
    time_to_target_s: float | None = None
    options: dict = field(default_factory=dict)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0


def flops_seconds_per_token(params: int, flops_per_s: float) -> float:
    """Forward + backward of one token: 6 N FLOPs (2 N forward, 4 N backward)."""
    return 6 * params / flops_per_s


def label(name: str, options: Options) -> str:
    """'diloco H=64': the knob that sets how often a strategy talks, where it has one."""
    period = getattr(options, "sync_every", None)
    return f"{name} H={period}" if period is not None else name


def predict(name: str, cluster: Cluster, options: Options | None = None, steps: int | None = None,
            shapes=None, seconds_per_token: float | None = None, overhead_s: float = 0.0) -> Prediction:
    """One strategy's step on `cluster`: steady state, or averaged over a run of `steps` steps
    (warm-up steps and a final sync included, as the strategy's plan_occurrences says)."""
    cls = get_strategy(name)
    options = options if options is not None else cls.Options()
    W, T = cluster.workers, cluster.tokens_per_step
    per_token = cluster.seconds_per_token if seconds_per_token is None else seconds_per_token
    unit = T / W * per_token                     # one 1x worker's compute per step
    compute = cluster.slowest * unit
    plan = cls.comm_plan(cluster.params, W, options, shapes=shapes)
    factors = cluster.slowdown or (1.0,) * W
    cost = StepCost(cluster.price, compute, cluster.accum, steps, tuple(f * unit for f in factors))
    exposed = cls.exposed_comm_s(plan, cost, options)
    rates = [cls.plan_rate(op, options, steps) for op in plan]
    comm = sum(cluster.price(op.collective, op.nbytes) * r for op, r in zip(plan, rates))
    wire = sum(op.wire_bytes(W) * r for op, r in zip(plan, rates))
    step = compute + overhead_s + exposed
    # tokens a step really computes: T, or more where workers keep computing while they wait
    tokens = T * cls.micro_batches_per_step(cost, comm, options) / cluster.accum
    return Prediction(
        strategy=name, label=label(name, options), step_s=step, compute_s=compute, overhead_s=overhead_s,
        exposed_comm_s=exposed, comm_s=comm, idle_s=sum(compute - f * unit for f in factors) / len(factors),
        wire_bytes_per_rank_per_step=wire, bytes_per_token=W * wire / tokens,
        model_state_bytes=cls.model_state_bytes(cluster.params, W, options),
        tokens_per_s=tokens / step if step > 0 else math.inf, tokens_per_step=tokens,
        options=asdict(options) if fields(options) else {})


def rank(preds: list[Prediction]) -> list[Prediction]:
    """Fastest first: by predicted time to the target loss where known, then by tokens/s."""
    return sorted(preds, key=lambda p: (p.time_to_target_s is None, p.time_to_target_s or 0.0, -p.tokens_per_s))


def recommend(ranked: list[Prediction], cluster: Cluster) -> str:
    """The first of `ranked`, and why, in words."""
    best = ranked[0]
    ratio = cluster.price("all_reduce", 4 * cluster.params) / best.compute_s if best.compute_s > 0 else math.inf
    comm = f"communication (one fp32 gradient all-reduce, {format_seconds(ratio * best.compute_s)}) is {ratio:.2g}x compute"
    overlapped = [p for p in ranked if get_strategy(p.strategy).comm_overlap > 0]
    if ratio < 0.05:
        why = f"{comm}: every strategy is compute-bound"
    elif ratio > 1 and overlapped:
        o = max(overlapped, key=lambda p: p.tokens_per_s)
        why = (f"{comm}: overlap alone cannot hide it ({o.label} still waits {100 * o.exposed_fraction:.0f}% "
               f"of its step); {best.label} " + ("does" if best.exposed_fraction < 0.1 else
                                                  f"waits least ({100 * best.exposed_fraction:.0f}%)"))
    else:
        why = f"{comm}; {best.label} waits {100 * best.exposed_fraction:.0f}% of its step on the network"
    if best.time_to_target_s is not None:
        nxt = next((p for p in ranked[1:] if p.time_to_target_s is not None), None)
        lead = (f", {nxt.time_to_target_s / best.time_to_target_s:.2f}x faster than {nxt.label}"
                if nxt is not None else "")
        return (f"use {best.label}: predicted to reach the target loss first ({format_seconds(best.time_to_target_s)}"
                f"{lead}, with the loss per token measured by the bench); {why}.")
    nxt = ranked[1] if len(ranked) > 1 else None
    lead = f", {best.tokens_per_s / nxt.tokens_per_s:.2f}x {nxt.label}'s" if nxt is not None else ""
    return (f"use {best.label}: the highest throughput ({best.tokens_per_s:,.0f} tokens/s{lead}); {why}. "
            f"Throughput only: how many tokens each strategy needs for a given loss is not modeled "
            f"without --calibrate.")


def format_seconds(s: float) -> str:
    if s >= 100:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{1000 * s:.3g} ms"

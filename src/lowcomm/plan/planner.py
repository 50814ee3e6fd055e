"""`lowcomm plan`: an analytic model of one training step for every registered strategy.

For N parameters, T tokens per step (all workers), W workers, one emulated link per
worker (comm/link.py) and per-worker slowdowns f_r:

    compute_s   = max_r f_r * (T / W) * seconds_per_token       (6 N FLOPs per token / FLOP/s, or measured)
    exposed_s   = cost.exposed_comm_s(plan, StepCost(...))      (cost: the strategy's engine's cost model)
    step_s      = compute_s + overhead_s + exposed_s            (overhead_s: per-step work outside the
                                                                 forward/backward, measured by --calibrate)
    tokens/s    = T * micro_batches_per_step / accum / step_s   (adaptive acco computes more while it waits)
    bytes/token = W * sum_op wire_bytes(op) * rate(op) / T
    memory      = cost.model_state_bytes(N, W, options)

With replica groups (--replicas R of W, K = W/R ranks each; plan/levels.py) the cost model's
level_plans prices each level on its own link: inside a replica on K ranks (--intra-link),
across replicas on R ranks (--link), the position of a replica that sends the most setting
the step; exposed_s adds the inside collectives in full to what the strategy leaves exposed
across (see predict), and bytes/token counts both levels.

Every collective is priced by LinkModel.duration, the formula the emulator sleeps by,
and every strategy's traffic comes from its own comm_plan of the model's real layout
(`model_layout`: the model built on the meta device; `--params N` sizes a GPT by the
rule of models/size.py first), what it overlaps from the cost model of its engine that it
names (`Strategy.cost`: contract/plan.py, engines/costs.py, costs_sharded.py,
outer_contract.py): nothing here knows what a strategy sends or overlaps.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache

import torch

from ..comm.link import LinkModel
from ..errors import UsageError
from ..models.build import build_run_model
from ..models.layout import ModelLayout, meta_layout
from ..models.size import ASPECT, HEAD_DIM, MAX_LAYERS, MAX_PARAMS, WIDTH_STEP, dims_for
from .levels import cluster_levels, inside_rate, replica_state_bytes
from ..strategies import get as get_strategy
from ..contract.options import Options
from ..contract.plan import StepCost
from ..contract.values import parse_count

MODEL_KEYS = ("preset", "n_layer", "n_head", "d_model")  # the model flags --params may come with


@dataclass
class Cluster:
    layout: ModelLayout         # the model's trainable shapes and blocks (N = layout.numel)
    workers: int                # W
    tokens_per_step: int        # T, all workers together
    seconds_per_token: float    # one 1x worker's forward+backward per token
    link: LinkModel | None = None
    slowdown: tuple = ()        # f_r per worker (empty: all 1)
    accum: int = 1              # micro-batches per step (ddp overlaps only the last one's backward)
    replicas: int = 0           # R replicas of W/R ranks (0: W, the flat cluster); `link` runs across them
    intra_link: LinkModel | None = None  # the link inside a replica (None: unshaped)
    inside: str = "ddp"         # what runs inside a replica (engines/inside.py)
    seq_len: int = 0            # tokens a sequence (--score's forwards: robust/costs.py)

    @property
    def params(self) -> int:
        return self.layout.numel

    def price(self, collective: str, nbytes: int) -> float:
        return self.link.duration(collective, nbytes, self.workers) if self.link is not None else 0.0

    @property
    def slowest(self) -> float:
        return max(self.slowdown, default=1.0)

    @property
    def groups(self) -> int:
        """R, the number of replicas (W: flat)."""
        return self.replicas or self.workers

    @property
    def flat(self) -> bool:
        return self.groups == self.workers


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
    tokens_asked: float = 0.0     # T, the batch the cluster was described with (0: unknown, taken as trained)
    tokens_to_target: float | None = None
    time_to_target_s: float | None = None
    options: dict = field(default_factory=dict)
    replicas: int = 0           # R the cluster ran as (W: flat)
    # per level ("intra", "cross"): ranks_per_group, groups, wire_bytes_per_rank_per_step (averaged
    # over the positions of a replica), bytes_per_token (all ranks), comm_s (the step's: across, the
    # position that sends the most)
    levels: dict = field(default_factory=dict)
    defence_s: float = 0.0      # an untrusted-workers defence's own work a step (robust/costs.py), in step_s
    defence: dict | None = None  # its DefenceWork, and the rates it was priced at

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def batch_as_asked(self) -> bool:
        """Whether a step trains the tokens asked (adaptive acco's grows it while it waits)."""
        return not self.tokens_asked or self.tokens_per_step <= self.tokens_asked * (1 + 1e-9)


def flops_seconds_per_token(params: int, flops_per_s: float) -> float:
    """Forward + backward of one token: 6 N FLOPs (2 N forward, 4 N backward)."""
    return 6 * params / flops_per_s


def model_layout(cfg) -> ModelLayout:
    """The layout of `cfg`'s model (lowcomm's GPT, or --model hf:<arch>), built on the meta
    device; a model of more than MAX_PARAMS parameters or MAX_LAYERS layers is refused."""
    params, n_layer = model_params(cfg), cfg.model.dims()[0]
    if params > MAX_PARAMS or n_layer > MAX_LAYERS:
        raise UsageError(f"the model has {params:.3g} parameters in {n_layer} layers, more than the plan builds "
                         f"(at most {MAX_PARAMS:.0e} in {MAX_LAYERS}); give smaller --n-layer or --d-model")
    return _built(cfg)


def model_params(cfg) -> int:
    """`cfg`'s model's parameter count, from the model itself at one and two layers (each layer
    adds the same count): quick at any depth."""
    one, two = (_built(_with(cfg, n_layer=n)).numel for n in (1, 2))
    return one + (cfg.model.dims()[0] - 1) * (two - one)


def _built(cfg) -> ModelLayout:
    return meta_layout(lambda: build_run_model(cfg, torch.device("meta")))


def _with(cfg, **model):
    """A copy of `cfg` whose model has these fields."""
    out = copy.copy(cfg)
    out.model = replace(cfg.model, **model)
    return out


def size_model(cfg, raw_params: str, given: set[str]) -> int:
    """Give `cfg` the model of about `raw_params` parameters (--params; models/size.py's rule)
    and return that count. `given`: the MODEL_KEYS set by flags; those dimensions are kept,
    the others (and any a config file set) follow from the count."""
    params = parse_count(raw_params, "--params")
    m = cfg.model
    if "preset" in given and m.hf_architecture is None:
        raise UsageError(f"--params and --model {m.preset} both set the model's size: give one "
                         f"(--n-layer, --n-head or --d-model may come with --params)")
    free = _with(cfg, preset=m.preset if m.hf_architecture is not None else "tiny",
                 **{k: getattr(m, k) if k in given else 0 for k in MODEL_KEYS[1:]})

    @cache
    def count(n_layer: int, n_head: int, d_model: int) -> int:
        return _built(_with(free, n_layer=n_layer, n_head=n_head, d_model=d_model)).numel

    try:
        dims = dims_for(params, count, free.model.n_layer, free.model.n_head, free.model.d_model)
    except ValueError as e:
        raise UsageError(f"--params {raw_params}: {e}; give the model with --model, --n-layer, --n-head, "
                         f"--d-model") from None
    cfg.model = replace(free.model, **dict(zip(MODEL_KEYS[1:], dims)))
    return params


def model_dims(cfg, layout: ModelLayout, asked: int | None = None) -> dict:
    """The model a plan priced: its architecture, dimensions and count (and the --params
    count it was sized from, if it was)."""
    n_layer, n_head, d_model = cfg.model.dims()
    return {"architecture": cfg.model.hf_architecture or "gpt", "n_layer": n_layer, "n_head": n_head,
            "d_model": d_model, "seq_len": cfg.model.seq_len, "params": layout.numel, "sized_from_params": asked}


def describe_model(dims: dict) -> str:
    """model_dims in one line, with the rule that sized the model from --params."""
    asked = dims["sized_from_params"]
    rule = (f"; sized from --params {asked:,}: d_model a multiple of {WIDTH_STEP} near {ASPECT} x n_layer, "
            f"head dim {HEAD_DIM}" if asked is not None else "")
    return (f"model: {'GPT' if dims['architecture'] == 'gpt' else 'hf:' + dims['architecture']} "
            f"--n-layer {dims['n_layer']} --n-head {dims['n_head']} --d-model {dims['d_model']} "
            f"--seq-len {dims['seq_len']}, {dims['params']:,} params{rule}")


def predict(name: str, cluster: Cluster, options: Options | None = None, steps: int | None = None,
            seconds_per_token: float | None = None, overhead_s: float = 0.0) -> Prediction:
    """One strategy's step on `cluster` (its model's layout priced by the strategy's comm_plan):
    steady state, or averaged over a run of `steps` steps (warm-up steps and a final sync
    included, as the strategy's cost model's plan_occurrences says)."""
    cls = get_strategy(name)
    options = options if options is not None else cls.Options()
    W, T = cluster.workers, cluster.tokens_per_step
    per_token = cluster.seconds_per_token if seconds_per_token is None else seconds_per_token
    unit = T / W * per_token                     # one 1x worker's compute per step
    compute = cluster.slowest * unit
    inside, across = cluster_levels(cls, cluster.layout, W, cluster.groups, options, cluster.link, cluster.intra_link,
                                    cluster.inside, cluster.accum)
    rate, in_rate = (lambda op: cls.cost.plan_rate(op, options, steps)), inside_rate(steps)
    plan = across.slowest(rate)  # flat: the strategy's one plan
    # Workers all alike (no --slowdown): one stands for all, so a plan of a million workers (and
    # --intra-link's try of every replica count) does not loop over each of them.
    factors = cluster.slowdown or (1.0,)
    cost = StepCost(across.price, compute, cluster.accum, steps, tuple(f * unit for f in factors))
    # The model of the level inside a replica: its collectives run in series with the step and
    # hide behind no compute (the reduce-scatter to the owners before the strategy's step, the
    # all-gather after it; ddp's reduce-scatter runs in its bucket hook, which holds up the
    # backward), so all of their time is exposed, on top of what the strategy leaves exposed
    # across replicas. An unshaped --intra-link costs nothing; a flat cluster has no inside.
    intra_s = inside.comm_s(inside.plans[0], in_rate)
    exposed = cls.cost.exposed_comm_s(plan, cost, options) + intra_s
    cross_s = across.comm_s(plan, rate)
    comm = cross_s + intra_s
    per_rank = {"intra": inside.wire_bytes_per_rank(in_rate), "cross": across.wire_bytes_per_rank(rate)}
    wire = per_rank["cross"] + per_rank["intra"]
    defence, defence_s = priced_defence(cls, options, cluster, per_token)
    step = compute + overhead_s + defence_s + exposed
    # tokens a step really computes: T, or more where workers keep computing while they wait
    tokens = T * cls.cost.micro_batches_per_step(cost, comm, options) / cluster.accum
    levels = {level.name: {"ranks_per_group": level.ranks, "groups": level.groups,
                           "wire_bytes_per_rank_per_step": per_rank[level.name],
                           "bytes_per_token": W * per_rank[level.name] / tokens, "comm_s": s}
              for level, s in ((inside, intra_s), (across, cross_s))}
    return Prediction(
        strategy=name, label=cls.cost.plan_label(cls, options), step_s=step, compute_s=compute, overhead_s=overhead_s,
        exposed_comm_s=exposed, comm_s=comm, idle_s=sum(compute - f * unit for f in factors) / len(factors),
        wire_bytes_per_rank_per_step=wire, bytes_per_token=W * wire / tokens,
        model_state_bytes=replica_state_bytes(cls, cluster.layout, W, cluster.groups, options, cluster.inside)
        + (defence["held_bytes"] if defence else 0),
        tokens_per_s=tokens / step if step > 0 else math.inf, tokens_per_step=tokens, tokens_asked=T,
        options=asdict(options) if fields(options) else {}, replicas=cluster.groups, levels=levels,
        defence_s=defence_s, defence=defence)


# A worker's memory bandwidth, where the plan knows only its sustained FLOP rate: an accelerator
# training at about 40 % of its peak FLOP/s against the bandwidth its memory sustains (H100 SXM:
# about 400 TFLOP/s to 3.35 TB/s, 120; A100: 125 to 2.0, 62). It prices the robust aggregate's
# memory traffic (robust/costs.py): a memory-bound pass, a few operations per value.
FLOPS_PER_BYTE = 100.0


def priced_defence(cls, options, cluster: Cluster, per_token: float) -> tuple[dict | None, float]:
    """The strategy's untrusted-workers defence (its cost model's DefenceWork) with the seconds a
    step it costs a worker whose FLOP rate does 6 N FLOPs a token in `per_token` s (0: unpriced)."""
    work = cls.cost.defence_work(options, cluster.groups, cluster.params, cluster.seq_len)
    if work is None:
        return None, 0.0
    flops = 6 * cluster.params / per_token if per_token > 0 else math.inf
    rates = {"memory_bytes_per_s": flops / FLOPS_PER_BYTE, "flops_per_s": flops}
    seconds = work.seconds(rates["memory_bytes_per_s"], flops)
    return {**asdict(work), **rates, "seconds_per_step": seconds}, seconds


def named(p: Prediction, workers: int) -> str:
    """A prediction as a recommendation names it: the strategy, and its replica count unless flat."""
    return p.label if p.replicas in (0, workers) else f"{p.label} with --replicas {p.replicas}"


# Predictions within 1 % of each other tie: the model prices a step from a link formula and a
# FLOP count, not to the percent, and a figure 1 % faster is no reason to take a larger batch
# or a longer wait than another setting's.
TIE = 0.01


def _cost(p: Prediction) -> tuple:
    """What ranks a prediction, smaller first: time to the target where known, else seconds per token."""
    if p.time_to_target_s is not None:
        return (False, p.time_to_target_s)
    return (True, 1 / p.tokens_per_s if p.tokens_per_s > 0 else math.inf)


def tied(p: Prediction, lead: Prediction) -> bool:
    """Whether `p` is as fast as `lead` within TIE (by the same measure)."""
    (unknown, cost), (lead_unknown, lead_cost) = _cost(p), _cost(lead)
    return unknown == lead_unknown and cost <= lead_cost * (1 + TIE)


def rank(preds: list[Prediction]) -> list[Prediction]:
    """Fastest first: by predicted time to the target loss where known, then by tokens/s. Those
    within TIE of the fastest left tie, and among them the one that trains the batch asked comes
    first, then the one that waits least on the network."""
    left, out = sorted(preds, key=_cost), []
    while left:
        group = [p for p in left if tied(p, left[0])]
        out += sorted(group, key=lambda p: (not p.batch_as_asked, p.exposed_fraction, _cost(p)))
        left = [p for p in left if not any(p is q for q in group)]
    return out


def tie_words(best: Prediction, ranked: list[Prediction], workers: int) -> str:
    """The runners-up that tie with `best`, and what each would cost instead ("" where none ties)."""
    alike, costlier = [], []
    for p in (p for p in ranked[1:] if tied(p, best)):
        why = []
        if best.batch_as_asked and not p.batch_as_asked:
            why.append(f"trains {p.tokens_per_step:,.0f} tokens a step, not the {p.tokens_asked:,.0f} asked")
        if p.exposed_fraction > best.exposed_fraction:
            why.append(f"waits {100 * p.exposed_fraction:.0f}% of its step on the network "
                       f"({best.label}: {100 * best.exposed_fraction:.0f}%)")
        if why:
            costlier.append(f"{named(p, workers)}, which " + " and ".join(why))
        else:
            alike.append(named(p, workers))
    said = ([" and ".join(alike) + " (the same batch, a wait no longer: either will do)"] if alike else []) + costlier
    return f"tied within {TIE:.0%} with " + "; and with ".join(said) if said else ""


def recommend(ranked: list[Prediction], cluster: Cluster) -> str:
    """The first of `ranked`, and why, in words (with its --replicas where it is not flat)."""

    best = ranked[0]
    ratio = cluster.price("all_reduce", 4 * cluster.params) / best.compute_s if best.compute_s > 0 else math.inf
    comm = f"communication (one fp32 gradient all-reduce, {format_seconds(ratio * best.compute_s)}) is {ratio:.2g}x compute"
    overlapped = [p for p in ranked if get_strategy(p.strategy).cost.comm_overlap > 0]
    waits_least = best.exposed_fraction <= min(p.exposed_fraction for p in ranked)
    if ratio < 0.05:
        why = f"{comm}: every strategy is compute-bound"
    elif ratio > 1 and overlapped:
        o = max(overlapped, key=lambda p: p.tokens_per_s)
        why = f"{comm}: overlap alone cannot hide it ({o.label} still waits {100 * o.exposed_fraction:.0f}% of its step)"
        if best.exposed_fraction < 0.1:
            why += f"; {best.label} does"
        elif waits_least or best is not o:
            why += f"; {best.label} waits {'least ' * waits_least}({100 * best.exposed_fraction:.0f}%)"
    else:
        why = f"{comm}; {best.label} waits {100 * best.exposed_fraction:.0f}% of its step on the network"
    if not best.batch_as_asked:  # adaptive acco: its tokens/s are of a larger batch than asked
        why += (f"; it trains {best.tokens_per_step:,.0f} tokens a step, not the {best.tokens_asked:,.0f} asked "
                f"(it computes while it waits)")
    if best.time_to_target_s is not None:
        nxt = next((p for p in ranked[1:] if p.time_to_target_s is not None), None)
        lead = (f", {nxt.time_to_target_s / best.time_to_target_s:.2f}x faster than {nxt.label}"
                if nxt is not None else "")
        lead = f", {tie_words(best, ranked, cluster.workers)}" if nxt is not None and tied(nxt, best) else lead
        return (f"use {named(best, cluster.workers)}: predicted to reach the target loss first ({format_seconds(best.time_to_target_s)}"
                f"{lead}, with the loss per token measured by the bench); {why}.")
    nxt = ranked[1] if len(ranked) > 1 else None
    lead = f", {best.tokens_per_s / nxt.tokens_per_s:.2f}x {nxt.label}'s" if nxt is not None else ""
    lead = f", {tie_words(best, ranked, cluster.workers)}" if nxt is not None and tied(nxt, best) else lead
    return (f"use {named(best, cluster.workers)}: the highest throughput ({best.tokens_per_s:,.0f} tokens/s{lead}); {why}. "
            f"Throughput only: how many tokens each strategy needs for a given loss is not modeled "
            f"without --calibrate.")


def format_seconds(s: float) -> str:
    if s >= 100:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{1000 * s:.3g} ms"

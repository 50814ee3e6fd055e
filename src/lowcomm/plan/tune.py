"""`lowcomm plan --tune`: each strategy's main knobs searched over a small grid on the cluster
planned, and its best setting reported next to its default.

Knobs are found by their Options field, so a strategy that declares `sync_every` or
`bucket_mb` is tuned without this module naming it. They are of two kinds:

- system knobs (bucket_mb, fragments) change when bytes move, not what is learned: the
  fastest setting predicted is the best one.
- quality knobs (sync_every, topk, bits, powersgd rank, max_accum, outer_delay, eager) trade what is learned per
  token for fewer or later bytes. Throughput alone cannot pick them: H = 256 always sends less
  than H = 64, 4 bits less than 8, so the fastest setting is always the most aggressive one.
  Without a loss-per-token measurement, the tuner keeps them inside a bound (H at most
  --max-sync-every, default DEFAULT_MAX_SYNC_EVERY; the others their grid) and picks the most
  conservative setting within SLACK of the best tokens/s there: where the network is no
  longer the bottleneck, a more aggressive setting buys nothing. With --calibrate and a
  target loss, a setting whose loss curve the bench measured is ranked by time to the target,
  and the plan says which settings the calibration did not cover.

Where the plan chooses the replica count (--intra-link without --replicas), each count is
searched with the knobs, as one more system knob: a strategy's quality setting is priced at
its fastest (bucket, fragments, R), so H is chosen knowing what R saves on the link.
plan/pick.py turns the tuned settings into the plan's one recommendation.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, fields, replace

from ..errors import UsageError
from ..strategies import get as get_strategy

DEFAULT_MAX_SYNC_EVERY = 64  # DiLoCo's paper finds loss flat up to H ~ 100 at its scale; 64 stays inside it
SLACK = 0.05                 # a quality knob is not pushed further for less than 5 % more tokens/s


@dataclass(frozen=True)
class Knob:
    field: str        # the Options field it sets
    grid: tuple       # values tried (a strategy's own default is tried too)
    quality: bool     # whether it changes what is learned per token (see the module doc)
    safe: str = ""    # quality knobs: "low" or "high", the direction that costs no quality
    runs_with: tuple = ()  # (value, {field: value}): the settings its source runs a value with


KNOBS = (
    Knob("sync_every", (8, 16, 32, 64, 128, 256), True, "low"),
    Knob("fragments", (1, 2, 4, 8, 16), False),
    Knob("topk", (4, 8, 16, 32, 64), True, "high"),
    Knob("bits", (8, 4), True, "high"),          # 1 bit is 1-bit Adam's (onebit_adam), not this knob's
    Knob("rank", (1, 2, 4, 8, 16), True, "high"),
    Knob("max_accum", (1, 2, 4, 8), True, "low"),  # multiples of --accum: micro-batches while waiting
    # an outer step a period late learns less per token; PCCL's async DiLoCo runs it without outer
    # momentum (a stale mean through momentum overshoots: docs/strategies.md)
    Knob("outer_delay", (0, 1), True, "low", runs_with=((1, {"outer_momentum": 0.0}),)),
    # with the outer step a period late, each worker's own pseudo-gradient standing in for the mean
    # in flight (Kale et al.) closes most of the delay's loss in their paper; it costs no byte and no time
    Knob("eager", (False, True), True, "high"),
    Knob("bucket_mb", (1, 5, 10, 25, 50, 100), False),
)


@dataclass
class Tuned:
    strategy: str
    knobs: dict                  # field -> {"flag", "default", "tuned", "tried"}
    default: object              # the Prediction at the strategy's given options
    best: object                 # the Prediction at the tuned options
    basis: str                   # how the setting was chosen, in words
    notes: list = field(default_factory=list)
    by_count: dict = field(default_factory=dict)  # R -> the tuned knobs' Prediction at that replica count


def knobs_of(name: str) -> list[Knob]:
    own = {f.name for f in fields(get_strategy(name).Options)}
    return [k for k in KNOBS if k.field in own]


def spelled(flag: str, value) -> list[str]:
    """A knob's value as command-line words: `--eager` / `--no-eager` for a switch."""
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{flag[2:]}"]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]


def flag_of(name: str, field_name: str) -> str:
    from ..contract.options import cli_flag
    return cli_flag(next(f for f in fields(get_strategy(name).Options) if f.name == field_name))


def candidates(name: str, options, layout, accum: int, max_sync_every: int) -> list:
    """Every valid combination of the strategy's knobs over their grids (bounds applied), its
    given options included; a combination its Options refuse (fragments > H) is skipped."""
    knobs = knobs_of(name)
    grids = []
    for k in knobs:
        grid = [v * accum for v in k.grid] if k.field == "max_accum" else list(k.grid)
        own = getattr(options, k.field)
        if k.field == "max_accum" and own == 0:
            own = 4 * accum  # 0 means 4 x accum (strategies/acco.py): the same setting, spelled out
        grid = sorted(set(grid) | {own})
        if k.field == "sync_every":
            grid = [h for h in grid if h <= max_sync_every]
        grids.append(grid)
    out = []
    for values in itertools.product(*grids):
        one = replace(options, **{k.field: v for k, v in zip(knobs, values)})
        for k, v in zip(knobs, values):
            one = replace(one, **dict(k.runs_with).get(v, {}))
        try:
            one.check()
            one.check_model(layout)
        except UsageError:
            continue
        out.append(one)
    return out


def tune(name: str, options, layout, accum: int, predict, reach=None, max_sync_every: int = DEFAULT_MAX_SYNC_EVERY,
         covered=None, counts: tuple = (0,)) -> Tuned | None:
    """The strategy's best setting on the cluster `predict(name, options, replicas) -> Prediction`
    prices; None where it has no knob. `counts`: the replica counts R it runs at, the first the
    one the plan chose at the given knobs; each is searched with the knobs as a system knob (R
    changes where bytes move, not the update a step computes). `reach(name, options)`: tokens to
    the target loss measured at those options, or None (no calibration, or not measured there);
    `covered`: the quality settings a calibration measured, for the note that says what it did not."""
    knobs = knobs_of(name)
    if not knobs:
        return None
    default = predict(name, options, counts[0])
    quality = [k for k in knobs if k.quality]
    preds = [(o, R, predict(name, o, R)) for R in counts
             for o in candidates(name, options, layout, accum, max_sync_every)]
    if not preds:
        return None

    def qkey(o):
        return tuple(getattr(o, k.field) for k in quality)
    per_quality = _fastest_per_quality(preds, options, [k for k in knobs if not k.quality], qkey, counts[0])
    notes = []
    timed = {}
    if reach is not None:
        for key, (o, p) in per_quality.items():
            tokens = reach(name, o)
            if tokens is not None:
                p.tokens_to_target, p.time_to_target_s = tokens, tokens / p.tokens_per_s
                timed[key] = (o, p)
    if timed:
        o, p = min(timed.values(), key=lambda op: op[1].time_to_target_s)
        basis = "time to the target loss (loss per token measured by the bench)"
        untimed = [k for k in per_quality if k not in timed]
        if untimed:
            notes.append(f"the calibration measured {_settings(quality, timed)} only; "
                         f"{_settings(quality, untimed)} not ranked by time to target")
    else:
        o, p = _within_slack(per_quality, quality)
        basis = _slack_basis(quality, max_sync_every)
        if quality and reach is not None and covered is not None:
            notes.append(f"the calibration does not cover {_settings(quality, [qkey(o)])}"
                         + (f" (it measured {covered})" if covered else ""))
    fields_set = [k.field for k in knobs] + [f for k in knobs for _, more in k.runs_with for f in more]
    chosen = {f: {"flag": flag_of(name, f), "default": getattr(options, f), "tuned": getattr(o, f)}
              for f in dict.fromkeys(fields_set)}
    # the chosen knobs at every replica count, each at its fastest system setting there: what R buys
    by_count = {R: max((q for oo, RR, q in preds if RR == R and qkey(oo) == qkey(o)), key=lambda q: q.tokens_per_s)
                for R in counts}
    return Tuned(name, chosen, default, p, basis, notes, by_count)


def _fastest_per_quality(preds, options, system: list[Knob], qkey, default_count) -> dict:
    """Each quality setting at its fastest system setting (bucket size, fragments, replica count):
    {quality values: (options, prediction)}. On a tie (the network idle either way) the given
    system setting, at the replica count the plan chose, stays."""
    def keeps_default(o, R):
        return R == default_count and all(getattr(o, k.field) == getattr(options, k.field) for k in system)
    best = {}
    for o, R, p in preds:
        key = qkey(o)
        if key not in best or (p.tokens_per_s, keeps_default(o, R)) > best[key][2]:
            best[key] = (o, p, (p.tokens_per_s, keeps_default(o, R)))
    return {key: (o, p) for key, (o, p, _) in best.items()}


def _slack_basis(quality: list[Knob], max_sync_every: int) -> str:
    if not quality:
        return "tokens/s (system knob: no effect on loss per token)"
    bound = f"H <= {max_sync_every}, " if any(k.field == "sync_every" for k in quality) else ""
    return (f"tokens/s: the most conservative {'/'.join(k.field for k in quality)} within "
            f"{SLACK:.0%} of the best ({bound}loss per token not modeled)")


def _within_slack(per_quality: dict, quality: list[Knob]):
    """The most conservative quality setting whose tokens/s is within SLACK of the best."""
    best = max(p.tokens_per_s for _, p in per_quality.values())
    near = [(key, op) for key, op in per_quality.items() if op[1].tokens_per_s >= (1 - SLACK) * best]

    def caution(key):  # smaller is safer: low-safe knobs as is, high-safe ones negated
        return tuple(v if k.safe == "low" else -v for k, v in zip(quality, key))
    return min(near, key=lambda kv: (caution(kv[0]), -kv[1][1].tokens_per_s))[1]


def _settings(quality: list[Knob], keys) -> str:
    return ", ".join(" ".join(f"{k.field}={v}" for k, v in zip(quality, key)) for key in keys) or "(none)"


def check_bound(value: int) -> int:
    if value < 1:
        raise UsageError(f"--max-sync-every must be at least 1, got {value}")
    return value


def table(tuned: list[Tuned], workers: int = 0) -> str:
    """Each strategy's default and tuned setting with their tokens/s, fastest tuned first."""
    from .planner import format_seconds as _s, rank
    if not tuned:
        return "tuned (--tune): none of the strategies planned has a knob to tune"
    from .text import columns

    # a replica count on every setting where any is grouped (the flat one as --replicas W): a
    # setting without one beside one with it would leave the reader to guess
    counted = any(p.replicas not in (0, workers) for t in tuned for p in (t.default, t.best))

    def setting(t, p, which):  # its knobs, and its replica count
        count = f" --replicas {p.replicas or workers}" if counted else ""
        return " ".join(" ".join(spelled(k["flag"], k[which])) for k in t.knobs.values()) + count
    order = [next(t for t in tuned if t.best is p) for p in rank([t.best for t in tuned])]  # as the answer ranks
    rows = []
    for t in order:
        rows.append([t.strategy, setting(t, t.default, "default"), f"{t.default.tokens_per_s:,.0f}",
                     setting(t, t.best, "tuned"), _s(t.best.step_s),
                     f"{t.best.tokens_per_s:,.0f}", f"{t.best.tokens_per_s / t.default.tokens_per_s:.2f}x",
                     _s(t.best.time_to_target_s) if t.best.time_to_target_s is not None else "-"])
    cols = ["strategy", "default", "tokens/s", "tuned", "step", "tokens/s", "x default", "time to target"]
    lines = [f"tuned (--tune): each strategy's knobs over a grid; quality knobs (H, top-k, bits, rank, max-accum, outer delay, "
             f"eager) "
             f"at the most conservative setting within {SLACK:.0%} of the best tokens/s, H at most "
             f"--max-sync-every, unless the calibration's loss per token ranks them by time to target. "
             f"Throughput alone cannot pick H: a larger H is always faster.", columns(cols, rows)]
    for t in tuned:
        lines += [f"{t.strategy}: {t.basis}"] + [f"{t.strategy}: {n}" for n in t.notes]
    return "\n".join(lines)


def tune_all(args, names, options, cluster, bench, target, predict_one, counts_of=lambda name: (0,),
             done=lambda name, i, n: None):
    """`--tune`: each strategy's best setting (None without --tune); `predict_one(name, options,
    replicas)` prices one setting, `counts_of(name)` the replica counts it runs at (the plan's
    choice at the given knobs first), searched together with the knobs; `done(name, i, n)` is
    told as each strategy's search ends (the i-th of n)."""
    from ..metrics.runs import reach
    from ..contract.values import convert

    if not args.tune:
        if args.max_sync_every is not None:
            raise UsageError("--max-sync-every bounds the H that --tune tries: give --tune with it")
        return None
    bound = (check_bound(convert(args.max_sync_every, "int", "--max-sync-every"))
             if args.max_sync_every is not None else DEFAULT_MAX_SYNC_EVERY)
    by_strategy = {}  # every run of the bench per strategy: a recipe may run one at several settings
    for e in bench.entries if bench is not None else ():
        if hasattr(e, "summary"):
            by_strategy.setdefault(e.summary["strategy"], []).append(e)

    def ran_at(e, name, k):
        """A bench run's value of option k (a run whose config predates the option ran its default)."""
        return e.config.get(name, {}).get(k, getattr(get_strategy(name).Options(), k))

    def measured_at(name, opts):
        """The bench run of `name` at the quality settings of `opts` (every quality knob equal)."""
        keys = [k.field for k in knobs_of(name) if k.quality]
        for e in by_strategy.get(name, ()):
            if all(ran_at(e, name, k) == getattr(opts, k) for k in keys):
                return e
        return None

    def reach_at(name, opts):
        e = measured_at(name, opts)
        return reach(e.curve, target, "tokens") if e is not None else None

    out = []
    for i, name in enumerate(names, 1):
        keys = [k.field for k in knobs_of(name) if k.quality]
        covered = "; ".join(" ".join(f"{k}={ran_at(e, name, k)}" for k in keys)
                            for e in by_strategy.get(name, ())) if bench is not None else None
        t = tune(name, options[name], cluster.layout, cluster.accum, predict_one,
                 reach_at if bench is not None and target is not None else None, bound, covered, counts_of(name))
        if t is not None:
            out.append(t)
        done(name, i, len(names))
    return out


def tuned_json(t) -> dict:
    return {"strategy": t.strategy, "knobs": t.knobs, "basis": t.basis, "notes": t.notes, "replicas": t.best.replicas,
            "default": asdict(t.default), "tuned": asdict(t.best),
            "by_replicas": [{"replicas": R, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s}
                            for R, p in t.by_count.items()]}

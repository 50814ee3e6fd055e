"""`lowcomm bench`: every chosen strategy on the same model, data order, seed, workers,
link and slowdowns, one after the other (with --repeats N, in N interleaved rounds), then one
report (bench/report/).

Each strategy is a normal `lowcomm train` run in OUT/<strategy> (launch.prepare +
launch.launch); bench.json lists them, with the error of any that failed, so
`lowcomm report OUT` and `lowcomm plan --calibrate OUT` can read the bench back.
Every run is validated before the first one starts: bad input writes nothing.
"""
from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import config as C
from ..errors import RunError, UsageError
from ..metrics.runlog import write_json_atomic
from . import machine
from .preflight import preflight
from .report import load_bench, write_report
from ..metrics.runs import BENCH_FILE, is_run
from ..plan.text import link_specs
from ..strategies import available
from ..strategies import get as get_strategy

# What `lowcomm bench` compares when --strategies is not given: the synchronous
# baselines, one overlapping, one infrequent and one compressing strategy.
DEFAULT_STRATEGIES = ("ddp", "zero1", "acco", "diloco", "demo")
DEFAULT_TOKENS = 300_000       # per strategy; sized so the default bench stays under 5 minutes on 2 cores
DEFAULT_LINK = "100mbit,10ms"  # a slow link, where the strategies differ
EVAL_POINTS = 8                # validation points per run when --eval-every is not given


@dataclass
class Planned:
    label: str
    cfg: C.RunConfig
    dir: str = ""        # its directory in the bench (default: the label)
    extra: dict = field(default_factory=dict)  # more to record in bench.json (a recipe's variant, point, seed)


def for_strategy(cfg: C.RunConfig, strategy: str) -> tuple[C.RunConfig, set[str]]:
    """A copy of cfg for `strategy` that keeps only the strategy options it declares, and only
    its own TOML table: one command line or config serves several strategies (--sync-every and
    [diloco] reach diloco, not ddp). Returns the copy and what it used: option fields, and
    '[name]' for its table."""
    out = copy.deepcopy(cfg)
    out.strategy = strategy
    own = {f for f in get_strategy(strategy).Options.__dataclass_fields__}
    out.pending_options = {k: v for k, v in cfg.pending_options.items() if k in own}
    out.options = {k: v for k, v in cfg.options.items() if k == strategy}
    return out, set(out.pending_options) | {f"[{k}]" for k in out.options}


def unused_options(cfg: C.RunConfig, used: set[str]) -> str | None:
    """The first strategy option (its flag) or table ('[acco]') given that none of the chosen
    strategies used (for_strategy's sets); None when each reached one."""
    given = [raw_name for key, (_, raw_name) in cfg.pending_options.items() if key not in used]
    return next(iter(given + [f"[{k}]" for k in cfg.options if f"[{k}]" not in used]), None)


def parse_strategies(text: str | None, default: list[str] | None = None) -> list[str]:
    """--strategies A,B,... (None: not given, so `default`, else the bench's defaults that are
    registered). An empty list is refused, not read as the default or as all of them."""
    if text is None:
        return default if default is not None else [s for s in DEFAULT_STRATEGIES if s in available()]
    names = [s.strip() for s in text.split(",")]
    if not all(names):
        raise UsageError(f"--strategies '{text}' must be a comma-separated list of strategies (none empty)")
    for name in names:
        get_strategy(name)  # UsageError naming the registered ones
    if len(set(names)) != len(names):
        raise UsageError(f"--strategies '{text}' names a strategy twice")
    return names


def parse_repeats(text: str | None) -> int:
    """--repeats N (None: not given, so 1): how many interleaved rounds of the strategies."""
    if text is None:
        return 1
    from ..contract.values import convert
    value = convert(text, "int", "--repeats")
    if value < 1:
        raise UsageError(f"--repeats {value} must be at least 1 (1: each strategy once)")
    return value


def plan_runs(base: C.RunConfig, strategies: list[str], out: Path, tokens: int | None,
              eval_every_given: bool, overwrite: bool) -> list[Planned]:
    """One validated config per strategy (UsageError before anything is written)."""
    from ..launch.launcher import prepare

    planned, used = [], set()
    for name in strategies:
        cfg, fields = for_strategy(base, name)
        used |= fields
        if tokens is not None and cfg.tokens_per_step > 0:  # (not: prepare names the bad count)
            # Every registered strategy consumes W·accum micro-batches per trainer step (acco:
            # at least that), so equal tokens means these steps, whatever a step means to it.
            cfg.steps = max(1, math.ceil(tokens / cfg.tokens_per_step))
        if not eval_every_given:
            cfg.eval_every = max(1, cfg.steps // EVAL_POINTS)
        cfg.out = str(out / name)
        prepare(cfg, create=False, overwrite=overwrite)
        planned.append(Planned(name, cfg))
    unused = unused_options(base, used)
    if unused:
        raise UsageError(f"{unused} applies to none of the strategies benched ({', '.join(strategies)})")
    return planned


def interleaved(planned: list[Planned], repeats: int) -> list[Planned]:
    """Every run `repeats` times, in rounds whose order alternates (A B C, then C B A, ...): each
    strategy runs next to the others in every round, a load that drifts during the bench falls on
    them alike, and the report compares them round by round (bench/report/conditions.py). Round
    i of a strategy runs in OUT/<strategy>/r<i>/."""
    if repeats == 1:
        return planned
    out = []
    for i in range(1, repeats + 1):
        for p in planned if i % 2 else planned[::-1]:
            cfg = copy.deepcopy(p.cfg)
            cfg.out = str(Path(p.cfg.out) / f"r{i}")
            out.append(Planned(f"{p.label} r{i}", cfg, f"{p.label}/r{i}", {"group": p.label, "round": i}))
    return out


def run_bench(base: C.RunConfig, strategies: list[str], tokens: int | None, target_loss: float | None,
              eval_every_given: bool, overwrite: bool, quiet: bool, repeats: int = 1) -> int:
    out = bench_dir(base.out, overwrite)
    planned = interleaved(plan_runs(base, strategies, out, tokens, eval_every_given, overwrite), repeats)
    preflight([p.cfg for p in planned], out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"lowcomm_bench": 1, "strategies": strategies, "tokens": tokens, "target_loss": target_loss,
            "workers": base.workers, "repeats": repeats, "machine": machine.at_start([p.cfg for p in planned]),
            "runs": []}
    try:
        _run_all(planned, meta, out, quiet)
    finally:  # also when interrupted: the runs that finished are reported
        rows = write_report(load_bench(out).entries, out, target_loss, title="lowcomm bench",
                            preamble=describe(meta, planned)) if meta["runs"] else []
    print((out / "report.md").read_text().split("\n\n![")[0], flush=True)
    print(f"\nbench: report, plots and runs in {out}/", flush=True)
    failed = [r["label"] for r in rows if r["status"] != "ok"]
    if failed:  # a script or CI job that runs the bench must see it, not only a reader of the table
        print(f"error: {len(failed)} of {len(rows)} runs failed ({', '.join(failed)}); the report shows the others",
              file=sys.stderr, flush=True)
    return 1 if failed or not rows else 0


def bench_dir(given: str, overwrite: bool, name: str = "bench") -> Path:
    """--out, or runs/<name>-<time>; refused when it is a file or holds a bench (unless overwrite)."""
    out = Path(given or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"output path '{out}' exists and is not a directory")
    if (out / BENCH_FILE).exists() and not overwrite:
        raise UsageError(f"output dir '{out}' already holds a bench; choose another --out or pass --overwrite")
    return out


def _run_all(planned: list[Planned], meta: dict, out: Path, quiet: bool) -> None:
    """Train each planned run in turn; a failure is recorded (bench.json) and the next one runs."""
    from ..launch.launcher import launch, prepare

    n = len(planned)
    for i, p in enumerate(planned, 1):
        print(f"\nbench: {'run' if p.extra else 'strategy'} {i} of {n}: {p.label} ({p.cfg.steps} steps, {p.cfg.steps * p.cfg.tokens_per_step:,} "
              f"tokens, W={p.cfg.workers})", flush=True)
        entry = {"strategy": p.cfg.strategy, "label": p.label, "dir": p.dir or p.label, "steps": p.cfg.steps,
                 "status": "ok", "error": None, **p.extra}
        try:
            launch(p.cfg, prepare(p.cfg, create=True, overwrite=True), quiet=quiet)
            if not is_run(Path(p.cfg.out)):
                raise RunError("the run wrote no summary.json")
        except (RunError, UsageError) as e:
            entry.update(status="failed", error=_one_line(e))
            print(f"bench: {p.label} failed: {entry['error']}", flush=True)
        entry["load"] = machine.load()  # over the run's last minute, its own workers included
        meta["runs"].append(entry)
        write_json_atomic(out / BENCH_FILE, meta)  # a bench cut short still reads back


def describe(meta: dict, planned: list[Planned]) -> str:
    cfg = planned[0].cfg
    spec = link_specs(cfg)
    R = cfg.replicas or cfg.workers
    where = (f"{R} replicas of {cfg.workers // R} ({cfg.inside} inside), link {spec['link']} across replicas, "
             f"intra-link {spec['intra_link']} inside" if R < cfg.workers else f"link {spec['link']}")
    rounds = meta.get("repeats", 1)
    return (f"{len(meta['strategies'])} strategies"
            + (f" in {rounds} interleaved rounds (each round in the other order)" if rounds > 1 else "")
            + f" on {cfg.workers} workers, model {cfg.model.preset} "
            f"(seq {cfg.model.seq_len}, micro-batch {cfg.micro_batch}, accum {cfg.accum}), seed {cfg.seed}, "
            f"data {cfg.data.source}, {where}"
            f", slowdown {','.join(f'{f:g}' for f in cfg.slowdown) or 'none'}"
            + (f", {meta['tokens']:,} tokens planned per strategy" if meta["tokens"] else "") + ".")


def _one_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else e.__class__.__name__
    return f"{lines[0]} {lines[-1]}"  # a worker's traceback: its head and its last line

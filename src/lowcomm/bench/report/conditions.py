"""The conditions each run was timed under, and whether the answer's ranking by time survives
them. On a machine that other jobs share, back-to-back runs meet very different loads (the
default bench once ran ddp at load 10.9 and acco at 24.5 on 2 cores), and a ranking by wall
time then measures the load as much as the strategies.

A run's load is the 1-minute load average at its end (summary.json's machine.load_at_end; the
run's own workers count in it). With L runnable threads on C cores, each gets C/L of a core once
L > C, so a step that computes takes up to max(L, C)/C times as long as on idle cores: the run's
*contention*. A higher load never makes a run faster, but it may slow one strategy by all of
its contention (one that computes the whole step) and another by little (one that waits on an
emulated link). So a claim about two runs' times -- "Y takes 1.3x X's time", or "X and Y are
equally fast" -- stands only if it still holds with Y's time scaled by the two runs'
contention ratio, the most the load alone could have moved it; otherwise the answer does not
rank by time and says why.

Pair by pair: runs of one round of `lowcomm bench --repeats N` ran next to each other (each
round in the other order), so a pair's time and contention ratios are the geometric means of
their per-round ratios, in which a load that drifts during the bench cancels out.
"""
from __future__ import annotations

import math
from statistics import median

# Runs whose time to the target is within this share of the fastest count as equally fast:
# back-to-back runs of one strategy on the shared 2-core machine differ by about this much.
TIME_NOISE = 0.05


def load_of(summary: dict) -> tuple[float, int] | None:
    """(load at the run's end, the cores it ran on), or None for a run that did not record them."""
    machine = summary.get("machine") or {}
    if "load_at_end" not in machine or not machine.get("cores"):
        return None
    return float(machine["load_at_end"]), int(machine["cores"])


def contention(summary: dict) -> float | None:
    """How many times longer a step that computes took than on idle cores, from the load: max(L, C)/C."""
    measured = load_of(summary)
    if measured is None:
        return None
    load, cores = measured
    return max(load, cores) / cores


def timing_dependent(summary: dict) -> str | None:
    """Why the run's own result -- its tokens, its loss -- moves with the timing (so with the
    load), or None where it depends only on its inputs."""
    options = summary.get("strategy_options") or {}
    if summary.get("strategy") == "acco" and options.get("deterministic") is False:
        return ("it computes micro-batches while it communicates, as many as the link and the load leave time "
                "for, so its tokens trained and its loss move from run to run (--deterministic: exactly --accum)")
    if options.get("sync_by") == "time":
        return ("it ends each inner phase after a set time, so its inner steps per sync and its loss move with "
                "the load (--sync-by steps: a set count)")
    return None


def combined(rows: list[dict]) -> list[dict]:
    """One row per strategy: a run's row as it is; the runs of a strategy repeated by `lowcomm
    bench --repeats` (same 'group') as one row of their medians, with 'runs' (round -> row)
    kept for the pair-by-pair ratios."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("group") or r["label"], []).append(r)
    out = []
    for label, runs in groups.items():
        if len(runs) == 1:  # a lone run, or the one round of a repeated strategy that finished
            out.append({**runs[0], "label": label, "runs": {runs[0].get("round"): runs[0]}})
            continue
        one = {**runs[0], "label": label, "runs": {r.get("round"): r for r in runs}}
        for key in ("time_to_target_s", "mb_to_target", "final_val_loss", "tokens", "contention", "load"):
            values = [r.get(key) for r in runs]
            one[key] = median(values) if None not in values else None  # not reached in every round: not reached
        out.append(one)
    return out


def ratios(x: dict, y: dict) -> tuple[float, float | None, int]:
    """(y's time to the target over x's, y's contention over x's (None: a load not recorded), the
    rounds compared): geometric means over the rounds both ran in, else their medians' ratios."""
    rounds = [k for k in x["runs"] if k is not None and k in y["runs"]]
    pairs = [(x["runs"][k], y["runs"][k]) for k in rounds] or [(x, y)]
    if any(a["time_to_target_s"] is None or b["time_to_target_s"] is None for a, b in pairs):
        pairs = [(x, y)]
    time_ratio = _geomean(b["time_to_target_s"] / max(a["time_to_target_s"], 1e-9) for a, b in pairs)
    loads = [(a.get("contention"), b.get("contention")) for a, b in pairs]
    load_ratio = None if any(None in p for p in loads) else _geomean(b / a for a, b in loads)
    return time_ratio, load_ratio, len(rounds)


def verdict(time_ratio: float) -> str:
    """What the answer says of a run that took `time_ratio` times another's time."""
    return "slower" if time_ratio > 1 + TIME_NOISE else "faster" if time_ratio < 1 / (1 + TIME_NOISE) else "as fast"


def confounded(fastest: dict, others: list[dict]) -> str | None:
    """Why the answer must not rank by time (None when it may): the first run whose claim
    against `fastest` -- slower, or as fast -- changes with its time scaled by their contention
    ratio, in words with the figures."""
    for other in others:
        time_ratio, load_ratio, rounds = ratios(fastest, other)
        if load_ratio is None or verdict(time_ratio) == verdict(time_ratio / load_ratio):
            continue
        over = f"; geometric means over {rounds} interleaved rounds" if rounds > 1 else ""
        return (f"{other['label']} took {time_ratio:.2f}x {fastest['label']}'s time to the target but ran under "
                f"{load_ratio:.2f}x its contention ({_loads(other)} against {_loads(fastest)}{over}), so the load "
                f"alone could make it {verdict(time_ratio / load_ratio)}")
    return None


def unrecorded(rows: list[dict]) -> list[str]:
    """Labels of the runs that recorded no load (older runs)."""
    return [r["label"] for r in rows if r.get("contention") is None]


def _loads(row: dict) -> str:
    runs = [r for r in row["runs"].values() if r.get("load") is not None]
    text = "/".join(f"{r['load']:.1f}" for r in runs)
    return f"load {text} on {runs[0]['cores']} cores" if runs else "load not recorded"


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))

"""report.md's "What slowed this run": for each run, the main cause with its figure, read from
what the run already wrote (summary.json, and steps.jsonl's per-rank times and flags).

The causes are tried in an order, and the first found is the main one: a straggler first,
since the fast ranks wait for it inside the collectives, so it also shows as exposed
communication (naming that instead would send the user to the network); then stalled
collectives (a peer that had not reached a collective for seconds, flagged while the run went,
diagnose/stalls.py: rare and specific, always named); then a slow link
(waits above what the emulated link model prices the bytes at, diagnose/slowlink.py); then
communication exposed for much of the wall time; then time outside compute and communication.
The others found are named after it; a run where none is found says that nothing stood out.
"""
from __future__ import annotations

import re
import statistics

from ...metrics.levels import LEVEL_WORDS, has_levels, level_figures
from ...diagnose.slowlink import ms
from ...diagnose.stragglers import RATIO as STRAGGLER_RATIO
from ...metrics.runs import RecordedRun

EXPOSED_SHARE = 0.25  # waiting on the network this much of the wall time is worth naming
OTHER_SHARE = 0.4     # so is this much of it outside compute and communication
WAIT_SHARE = 0.05     # the others' extra wait for a straggler, worth naming above this share
SLOW_LINK_STEPS = 0.2  # a slow link on this share of the steps, not a step or two of noise


def rank_times(run: RecordedRun) -> list[tuple[float, float, float]]:
    """Each rank's (compute, exposed communication, other) seconds over the run; other is
    the rest of the wall time: optimizer, compression, evaluation, waiting for slower ranks
    outside a collective."""
    s = run.summary
    return [(c, e, max(0.0, s["wall_s"] - c - e))
            for c, e in zip(s["compute_s_per_rank"], s["exposed_comm_s_per_rank"])]


def causes(run: RecordedRun) -> list[dict]:
    """What slowed `run`, main cause first: {"cause", "text"} each ([] when nothing stood out)."""
    straggler = _straggler(run)
    # With a straggler, the others' exposed time is mostly their wait for it: not named twice.
    found = [straggler, _stalls(run), _slow_link(run), None if straggler else _exposed(run), _other(run)]
    return [c for c in found if c is not None]


def section(runs: list[RecordedRun]) -> str:
    """The Markdown section: one paragraph for one run, a bullet per run for several."""
    if not runs:
        return ""
    lines = [f"**{r.label}**: {sentence(r)}" for r in runs]
    head = "## What slowed this run\n\n" if len(runs) == 1 else "## What slowed these runs\n\n"
    return "\n" + head + ("\n".join(f"- {line}" for line in lines) if len(runs) > 1 else lines[0]) + "\n"


def sentence(run: RecordedRun) -> str:
    found = causes(run)
    if not found:
        c, e, o = (sum(t[i] for t in rank_times(run)) for i in range(3))
        wall = max(c + e + o, 1e-12)
        return (f"nothing stood out: per rank, {100 * c / wall:.0f} % of the time computing, "
                f"{100 * e / wall:.0f} % waiting on the network, {100 * o / wall:.0f} % other.")
    text = found[0]["text"] + "."
    if len(found) > 1:
        text += " Also: " + "; ".join(c["text"] for c in found[1:]) + "."
    return text


def _straggler(run: RecordedRun) -> dict | None:
    """A rank whose median compute per step is STRAGGLER_RATIO times the others' (the run-time
    flag's rule, diagnose/stragglers.py, over the whole run rather than its last steps)."""
    per_step = [r["per_rank"]["compute_s"] for r in run.steps if "per_rank" in r]
    if per_step:
        medians = [statistics.median(step[k] for step in per_step) for k in range(len(per_step[0]))]
    else:  # a log without per-rank times: the run's totals over its steps
        medians = [c / max(run.summary["steps"], 1) for c in run.summary["compute_s_per_rank"]]
    if len(medians) < 2:
        return None
    rank = max(range(len(medians)), key=lambda k: medians[k])
    others = statistics.median(m for k, m in enumerate(medians) if k != rank)
    if not others > 0 or medians[rank] < STRAGGLER_RATIO * others:
        return None
    text = (f"rank {rank} computed {medians[rank] / others:.1f}x slower than the others (median compute per "
            f"step {ms(medians[rank])} vs {ms(others)}): a straggler")
    factors = run.summary.get("slowdown") or []
    if rank < len(factors) and factors[rank] != 1.0:
        text += f" (emulated: --slowdown made it x{factors[rank]:g})"
    # Its own exposed time is the link's; the others' is that plus their wait for it, unless an
    # emulated link's time covers its lateness (the modeled transfer starts at each rank's issue).
    times, wall = rank_times(run), run.summary["wall_s"]
    others_wait = statistics.mean(e for k, (_, e, _) in enumerate(times) if k != rank)
    if wall > 0 and others_wait - times[rank][1] > WAIT_SHARE * wall:
        text += (f"; the others waited for it, {100 * (others_wait - times[rank][1]) / wall:.0f} % of the wall "
                 f"time more in communication than it")
    return {"cause": "straggler", "rank": rank, "ratio": medians[rank] / others, "text": text}


def _stalls(run: RecordedRun) -> dict | None:
    """The stalled-collective flags of the run: how many, how long in all, the longest."""
    stalls = [(float(m[2]), m[1], int(m[3] or r["step"])) for r in run.steps for f in r.get("flags", [])
              for m in [re.fullmatch(r"(stalled .* (\d+(?:\.\d+)?) s)(?: \(step (\d+)\))?", f)] if m]
    if not stalls:
        return None
    _, flag, step = max(stalls)
    total = sum(s for s, _, _ in stalls)
    wall = run.summary["wall_s"]
    share = f", {100 * total / wall:.0f} % of the wall time" if wall > 0 else ""
    return {"cause": "stalled collective", "text": (
        f"{len(stalls)} stalled collective{'s' if len(stalls) > 1 else ''} held every rank up for "
        f"{total:.1f} s{share}; the longest at step {step}: {flag}")}


def _slow_link(run: RecordedRun) -> dict | None:
    """Steps the run flagged as slow-link, when there are enough of them to be the link's fault."""
    slow = [r for r in run.steps if any(f.startswith("slow link") for f in r.get("flags", []))]
    if not run.steps or len(slow) < SLOW_LINK_STEPS * len(run.steps):
        return None
    exposed = statistics.median(min(r["per_rank"]["exposed_comm_s"]) for r in slow)
    model = statistics.median(r["link_model_s"] for r in slow)
    return {"cause": "slow link", "text": (
        f"the link was slower than its model on {len(slow)} of {len(run.steps)} steps (median exposed "
        f"{ms(exposed)} per step vs {ms(model)} the link model prices the bytes at, x{exposed / model:.1f})")}


def _exposed(run: RecordedRun) -> dict | None:
    s = run.summary
    share = s.get("exposed_comm_fraction", 0.0)
    if share < EXPOSED_SHARE:
        return None
    text = f"communication was exposed for {100 * share:.0f} % of the wall time"
    if has_levels(s):  # which link the waits were on: the fix differs (fewer bytes across, or inside)
        waits = {level: waited for level, (_, waited) in level_figures(s).items()}
        level = max(waits, key=waits.get)
        if sum(waits.values()) > 0:
            text += f", {100 * waits[level] / sum(waits.values()):.0f} % of it {LEVEL_WORDS[level]}"
    link = s.get("link")
    priced = sum(r.get("link_model_s", 0.0) for r in run.steps)
    if link and link.get("bandwidth") and priced > 0 and s["wall_s"] > 0:
        # set beside what the link model prices the bytes at: as much means the link is just
        # this slow (send fewer bytes, or overlap them), not that something went wrong on it
        text += (f" (the emulated link {link['bandwidth']},{link.get('latency', '?')} prices the bytes sent at "
                 f"{100 * priced / s['wall_s']:.0f} % of it)")
    return {"cause": "exposed communication", "share": share, "text": text}


def _other(run: RecordedRun) -> dict | None:
    times = rank_times(run)
    wall = run.summary["wall_s"]
    other = statistics.mean(o for _, _, o in times) if times else 0.0
    if not wall > 0 or other < OTHER_SHARE * wall:
        return None
    return {"cause": "other", "text": (
        f"{100 * other / wall:.0f} % of the wall time went outside compute and communication "
        f"(optimizer, compression, evaluation: mean over ranks)")}


"""report.md's section on untrusted workers (docs/untrusted.md): for each run with an emulated
attack, a robust aggregate or --score, what its summary says of them, and with --score every
worker's score round by round, who was left out and what was named, and what the scoring cost:
each round's seconds of scoring work (the slowest worker's) against the wall time of the steps
since the previous scored step (the issue's target: at most 5 % of a worker's round).

The rounds come from summary.json, or from steps.jsonl's `score_rounds` where the summary has
none (a run that ended before writing them); the seconds only from steps.jsonl."""
from __future__ import annotations

from ...metrics.runs import RecordedRun
from ...metrics.summary import describe_untrusted

SHARE_TARGET = 0.05  # the issue's: scoring at most 5 % of a worker's round


def section(runs: list[RecordedRun]) -> str:
    """The Markdown section ('' when no run had an attacker, a robust aggregate or scoring)."""
    told = [(r, summary) for r in runs for summary in [_with_rounds(r)] if describe_untrusted(summary)]
    if not told:
        return ""
    return "\n## Untrusted workers\n" + "".join(_run(r, summary) for r, summary in told)


def _with_rounds(run: RecordedRun) -> dict:
    """The run's summary, with steps.jsonl's rounds where it has none of its own."""
    if run.summary.get("score_rounds"):
        return run.summary
    logged = [k for rec in run.steps for k in rec.get("score_rounds", ())]
    return {**run.summary, "score_rounds": logged} if logged else run.summary


def _run(run: RecordedRun, summary: dict) -> str:
    text = f"\n**{run.label}**:{describe_untrusted(summary)}\n"
    rounds = summary.get("score_rounds")
    if not rounds:
        return text
    timing = round_timing(run.steps)
    world = max((len(k["scores"]) for k in rounds if k.get("scores")), default=summary.get("workers", 0))
    timed = ["step", "scoring s", "round s", "share"] if timing else []
    head = ["round", *(f"worker {w}" for w in range(world)), "named", *timed]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for k in rounds:
        scores = k.get("scores") or [None] * world
        cells = [("–" if s is None else f"{s:+.4f}") + (" **out**" if w in k["left_out"] else "")
                 for w, s in enumerate(scores)]
        lines.append(f"| {k['round']} | " + " | ".join(cells) + f" | {'; '.join(k['events'])} |" +
                     "".join(f" {c} |" for c in _cost(timing, k["round"])))
    return text + "\nScores (Gauntlet's: the relative loss change of another worker's data):\n\n" + \
        "\n".join(lines) + "\n" + _share_said(timing)


def _cost(timing: dict, k: int) -> list[str]:
    """A round's step, seconds of scoring work, wall seconds and share (none without timing)."""
    if not timing:
        return []
    step, seconds, wall = timing.get(k, (None, None, None))
    if seconds is None:
        return ["–" if step is None else str(step), "–", "–", "–"]
    return [str(step), f"{seconds:.3f}", f"{wall:.3f}", f"{100 * seconds / wall:.1f} %" if wall > 0 else "–"]


def round_timing(steps: list[dict]) -> dict[int, tuple[int, float | None, float]]:
    """Round -> (its step, its seconds of scoring work (the slowest worker's; None where not
    logged), the wall seconds of the steps since the previous scored step, this one included:
    the round's wall time, shared by the rounds of one step)."""
    out, wall = {}, 0.0
    for rec in steps:
        wall += rec["wall_s"]
        for k in rec.get("score_rounds", ()):
            out[k["round"]] = (rec["step"], k.get("score_s"), wall)
        if rec.get("score_rounds"):
            wall = 0.0
    return out if any(s is not None for _, s, _ in out.values()) else {}


def scoring_seconds(timing: dict) -> tuple[float, float] | None:
    """(seconds of scoring work, wall seconds of the scored rounds' steps) over the rounds of
    `timing` (round_timing) whose scoring was logged; None where none was."""
    timed = [(step, s, wall) for step, s, wall in timing.values() if s is not None]
    if not timed:
        return None
    return sum(s for _, s, _ in timed), sum({step: wall for step, _, wall in timed}.values())


def _share_said(timing: dict) -> str:
    """The scoring's share of the scored rounds' wall time, against the target."""
    seconds = scoring_seconds(timing)
    if seconds is None:
        return ""
    scoring, wall = seconds
    share = scoring / max(wall, 1e-12)
    return (f"\nScoring took {scoring:.3f} s of the {wall:.3f} s of wall time of the scored rounds' "
            f"steps ({100 * share:.1f} %, the slowest worker's each round; the target is at most "
            f"{100 * SHARE_TARGET:.0f} %: {'met' if share <= SHARE_TARGET else 'not met'}).\n")

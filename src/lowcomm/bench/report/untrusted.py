"""report.md's section on untrusted workers (docs/untrusted.md): for each run with an emulated
attack, a robust aggregate or --score, what its summary says of them, and with --score every
worker's score round by round, who was left out and what was named."""
from __future__ import annotations

from ...metrics.runs import RecordedRun
from ...metrics.summary import describe_untrusted


def section(runs: list[RecordedRun]) -> str:
    """The Markdown section ('' when no run had an attacker, a robust aggregate or scoring)."""
    told = [r for r in runs if describe_untrusted(r.summary)]
    if not told:
        return ""
    return "\n## Untrusted workers\n" + "".join(_run(r) for r in told)


def _run(run: RecordedRun) -> str:
    text = f"\n**{run.label}**:{describe_untrusted(run.summary)}\n"
    rounds = run.summary.get("score_rounds")
    if not rounds:
        return text
    world = len(rounds[0]["scores"]) if rounds[0].get("scores") else run.summary.get("workers", 0)
    lines = ["| round | " + " | ".join(f"worker {w}" for w in range(world)) + " | named |",
             "|---" * (world + 2) + "|"]
    for k in rounds:
        scores = k.get("scores") or [None] * world
        cells = [("–" if s is None else f"{s:+.4f}") + (" **out**" if w in k["left_out"] else "")
                 for w, s in enumerate(scores)]
        lines.append(f"| {k['round']} | " + " | ".join(cells) + f" | {'; '.join(k['events'])} |")
    return text + "\nScores (Gauntlet's: the relative loss change of another worker's data):\n\n" + \
        "\n".join(lines) + "\n"

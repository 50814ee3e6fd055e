"""The paragraph report.md opens with: which run reached the target first in time, which
with the fewest bytes, and which to pick for the measured setting, and why -- unless the runs'
loads differ more than their times do (conditions.py), when it says so instead of ranking by
time. The runs of a strategy repeated by `lowcomm bench --repeats` count as one, compared with
the others round by round."""
from __future__ import annotations

from .conditions import TIME_NOISE, combined, confounded, unrecorded
from .levels import level_sentence
from .table import REGRESSED

# A pick whose own final loss is this much above the lowest one is said to be (the default
# target is the loss every run reached, so the pick may be the run that only just got there).
FINAL_LOSS_GAP = 0.02


def answer(rows: list[dict], target: float | None, setting: str) -> str:
    """`rows`: table.row() dicts, with 'comparable' set; `setting`: the measured setup in words."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("comparable", True) and not r.get("diverged")
          and not r.get("regressed") and r.get("finished", True)]
    notes = _caveats(rows)
    if not ok:
        return " ".join(["**Answer.** No run finished, so there is nothing to recommend.", *notes])
    runs, ok = ok, combined(ok)
    reached = [r for r in ok if r["time_to_target_s"] is not None]
    if not reached:
        best = min(ok, key=lambda r: r["final_val_loss"])
        text = (f"**Answer.** No run reached the target loss {target:.4f}; the lowest final loss is "
                f"**{best['label']}**'s ({best['final_val_loss']:.4f}). Lower --target-loss no further than that, "
                f"or train longer (--tokens).")
        return " ".join([text, *_by_level(runs), *notes])
    by_time = sorted(reached, key=lambda r: r["time_to_target_s"])
    fastest = by_time[0]
    fewest = min(reached, key=lambda r: (r["mb_to_target"], r["time_to_target_s"]))
    doubt = confounded(fastest, by_time[1:])
    if doubt:
        return " ".join([f"**Answer.** Target loss {target:.4f}, on {setting}.",
                         f"Not ranked by time, nor picked: {doubt}. {_rerun(runs)}",
                         f"Fewest bytes to it, which the load does not move: **{fewest['label']}** "
                         f"({fewest['mb_to_target']:,.2f} MB).", *_by_level(runs), *notes])
    tied = [r for r in by_time if r["time_to_target_s"] <= fastest["time_to_target_s"] * (1 + TIME_NOISE)]
    pick = min(tied, key=lambda r: (r["mb_to_target"], r["optimizer_state_mb_per_rank"], r["time_to_target_s"]))

    # the runner-up is named only where the loads cannot explain its lead over the others
    runner_up = len(by_time) > 1 and not confounded(by_time[1], by_time[2:])
    text = [f"**Answer.** Target loss {target:.4f}, on {setting}.",
            f"First to reach it: **{fastest['label']}** ({_s(fastest)}" +
            (f"; next {by_time[1]['label']}, {_s(by_time[1])})." if runner_up else ")."),
            f"Fewest bytes to it: **{fewest['label']}** ({fewest['mb_to_target']:,.2f} MB"
            + (f", {_ratio(fastest['mb_to_target'], fewest['mb_to_target'])} fewer than {fastest['label']})."
               if fewest is not fastest else ").")]
    why = _why(pick, fastest, fewest, tied)
    text.append(f"Pick **{pick['label']}** for this setting: {why}.")
    best = min(ok, key=lambda r: r["final_val_loss"])
    if pick["final_val_loss"] > best["final_val_loss"] * (1 + FINAL_LOSS_GAP):
        gap = 100 * (pick["final_val_loss"] / best["final_val_loss"] - 1)
        text.append(f"But mind where it ends: {pick['label']}'s final loss {pick['final_val_loss']:.4f} is "
                    f"{gap:.0f}% above {best['label']}'s {best['final_val_loss']:.4f}; to compare them at a lower "
                    f"loss, give --target-loss (or train longer).")
    return " ".join(text + _by_level(runs) + notes)


def _why(pick: dict, fastest: dict, fewest: dict, tied: list[dict]) -> str:
    if pick is fastest and pick is fewest:
        return "it reaches the target first and sends the fewest bytes"
    if pick is not fastest:
        gap = 100 * (pick["time_to_target_s"] / fastest["time_to_target_s"] - 1)
        because = ("sends " + _ratio(fastest["mb_to_target"], pick["mb_to_target"]) + " fewer bytes"
                   if pick["mb_to_target"] < fastest["mb_to_target"] else "keeps less optimizer state per rank")
        return (f"within {gap:.0f}% of {fastest['label']}'s time (under the {100 * TIME_NOISE:.0f}% that repeated "
                f"runs vary by) and it {because}")
    slower = fewest["time_to_target_s"] / pick["time_to_target_s"]
    return (f"it reaches the target first; {fewest['label']} sends "
            f"{_ratio(pick['mb_to_target'], fewest['mb_to_target'])} fewer bytes but takes {slower:.1f}x as long "
            f"here, which pays off only on a slower link (`lowcomm plan --calibrate` with that --link predicts "
            f"the ranking there)")


def _rerun(runs: list[dict]) -> str:
    """What to run for an answer by time: interleaved rounds, or more of them."""
    rounds = max((r.get("round") or 1 for r in runs), default=1)
    if rounds == 1:
        return ("Rerun on a quieter machine, or with --repeats 2 (each strategy twice, interleaved, and compared "
                "round by round).")
    return f"Rerun on a quieter machine, or with more rounds (--repeats {rounds + 1} or more)."


def _by_level(ok: list[dict]) -> list[str]:
    """The level sentence, where a run has replica groups (none for flat runs)."""
    text = level_sentence(ok)
    return [text] if text else []


def _caveats(rows: list[dict]) -> list[str]:
    out = []
    failed = [r["label"] for r in rows if r["status"] != "ok"]
    if failed:
        out.append(f"Failed, so left out: {', '.join(failed)} (see the table).")
    cut = [r for r in rows if r["status"] == "ok" and not r.get("finished", True)]
    if cut:
        out.append("Did not finish (no summary.json: stopped, killed or crashed), so left out of the target and this "
                   "answer, and read from its steps.jsonl and config.toml (no final loss, tokens/s, optimizer state "
                   "or peak memory): " + ", ".join(f"{r['label']} ({_how_far(r)})" for r in cut) + ".")
    apart = [r["label"] for r in rows if r["status"] == "ok" and not r.get("comparable", True)]
    if apart:
        out.append(f"Not comparable with the others, so left out of this answer: {', '.join(apart)} "
                   f"(marked † in the table).")
    worse = [r for r in rows if r["status"] == "ok" and r.get("diverged")]
    if worse:
        out.append("Ended above the loss it started at (diverged), so left out of the target and this answer: "
                   + ", ".join(f"{r['label']} ({r['final_val_loss']:.4f}, from {r['starting_loss']:.4f})"
                               for r in worse) + ".")
    late = [r for r in rows if r["status"] == "ok" and r.get("regressed") and not r.get("diverged")]
    if late:
        out.append(f"Got worse at its end (final loss over {100 * REGRESSED:.0f}% above its own best), so left out "
                   "of the target and this answer: " + ", ".join(
                       f"{r['label']} ({r['final_val_loss']:.4f} at its end, {r['best_val_loss']:.4f} at step "
                       f"{r['best_val_step']})" for r in late) + ".")
    unknown = unrecorded([r for r in rows if r["status"] == "ok" and "contention" in r and r.get("finished", True)])
    if unknown:
        out.append(f"No load recorded for {', '.join(unknown)} (older runs): times compared as measured.")
    more = [r for r in rows if r["status"] == "ok" and r.get("tokens_planned") and r["tokens"] > r["tokens_planned"]]
    if more:
        out.append("Trained more tokens than planned (their steps computed extra micro-batches: see each "
                   "strategy's docs): " + ", ".join(
                       f"{r['label']} {r['tokens']:,} (+{100 * (r['tokens'] / r['tokens_planned'] - 1):.0f}%)"
                       for r in more) + ".")
    return out


def _how_far(row: dict) -> str:
    """How far a run that did not finish got: its last step and its best validation loss."""
    best = row.get("best_val_loss")
    return f"to step {row['steps']} of {row['steps_planned']}" + (
        f", best validation loss {best:.4f} at step {row['best_val_step']}" if best is not None else "")


def _s(row: dict) -> str:
    rounds = len(row.get("runs", ()))
    return f"{row['time_to_target_s']:.1f} s" + (f", median of {rounds} rounds" if rounds > 1 else "")


def _ratio(more: float, less: float) -> str:
    return f"{more / less:,.1f}x" if less > 0 else "infinitely"

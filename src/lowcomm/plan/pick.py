"""The one answer of `lowcomm plan --tune`: the setting to use (strategy, knobs, replica count)
and the command line that trains with it.

Without --tune the plan recommends the fastest strategy at the options given. With --tune
each strategy is first tuned (plan_tune.tune: its knobs, and the replica count where
--intra-link asks for one, searched together); the recommendation is then the first of
those tuned settings, ranked as the table ranks strategies (planner.rank), so the line that
says what to use never names a setting the tuner found slower than another it printed.
A strategy with no knob competes at the options given, at its fastest replica count.
"""
from __future__ import annotations

from ..strategies import get as get_strategy
from .planner import Prediction, named, rank, recommend
from .replica_sizes import recommend_count
from .tune import spelled


def finalists(tuned: list, by_count: dict) -> list[Prediction]:
    """Each strategy at its best, fastest first: its tuned setting, or (no knob to tune) its
    prediction at the given options at the replica count that ranks first for it."""
    best = {t.strategy: t.best for t in tuned}
    untuned: dict[str, list[Prediction]] = {}
    for ranked in by_count.values():
        for p in ranked:
            if p.strategy not in best:
                untuned.setdefault(p.strategy, []).append(p)
    return rank(list(best.values()) + [rank(preds)[0] for preds in untuned.values()])


def per_count(best: Prediction, tuned: list, by_count: dict) -> list[Prediction]:
    """The recommended setting at every replica count it runs at (its system knobs the fastest
    there): what the replica count alone buys."""
    t = next((t for t in tuned if t.strategy == best.strategy), None)
    out = (list(t.by_count.values()) if t is not None
           else [p for ranked in by_count.values() for p in ranked if p.strategy == best.strategy])
    if best.tokens_to_target is not None:  # loss per token is taken not to depend on the replica count
        for p in out:
            p.tokens_to_target = best.tokens_to_target
            p.time_to_target_s = best.tokens_to_target / p.tokens_per_s
    return out


def command(best: Prediction, tuned: list, cfg) -> str:
    """`lowcomm train` with the recommended strategy, replica count and every tuned knob (those
    at the strategy's own default go without saying)."""
    words = ["lowcomm", "train", "--strategy", best.strategy, "--workers", str(cfg.workers)]
    if best.replicas not in (0, cfg.workers):
        words += ["--replicas", str(best.replicas), "--inside", cfg.inside]
    if cfg.accum > 1:
        words += ["--accum", str(cfg.accum)]
    t = next((t for t in tuned if t.strategy == best.strategy), None)
    defaults = get_strategy(best.strategy).Options()
    for field, knob in t.knobs.items() if t is not None else ():
        if knob["tuned"] != getattr(defaults, field):
            words += spelled(knob["flag"], knob["tuned"])
    return " ".join(words)


def answer(tuned: list, by_count: dict, cluster, cfg, choosing: bool) -> tuple[Prediction, str]:
    """The recommended tuned setting and the lines that say why and how to run it."""
    from dataclasses import replace

    ranked = finalists(tuned, by_count)
    best = ranked[0]
    lines = []
    if choosing:
        lines.append(recommend_count(per_count(best, tuned, by_count), cfg.workers, one_setting=True).replace(
            "replica size:", "replica size (searched with the knobs):", 1))
    said = f"use {named(best, cfg.workers)}:"
    lines.append(recommend(ranked, replace(cluster, replicas=best.replicas)).replace(
        said, said[:-1] + " (tuned; the command below):", 1))
    t = next((t for t in tuned if t.strategy == best.strategy), None)
    lines += [f"caveat: {note}" for note in (t.notes if t is not None else ())]  # e.g. a knob no bench measured
    lines.append(f"command: {command(best, tuned, cfg)}")
    return best, "\n".join(lines)


def recommended_json(best: Prediction, tuned: list, cfg) -> dict:
    t = next((t for t in tuned if t.strategy == best.strategy), None)
    return {"strategy": best.strategy, "label": best.label, "replicas": best.replicas,
            "knobs": {f: k["tuned"] for f, k in t.knobs.items()} if t is not None else {},
            "step_s": best.step_s, "tokens_per_s": best.tokens_per_s, "time_to_target_s": best.time_to_target_s,
            "command": command(best, tuned, cfg)}

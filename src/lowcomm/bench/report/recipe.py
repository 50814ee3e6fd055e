"""report.md and report.json of a recipe bench (`lowcomm bench RECIPE.toml`): the answer and
a table of each variant at its own best setting against the baseline, the whole grid (every
setting tried, its loss over seeds), every run, and the plots: the usual five of each
variant at its best setting (its first seed), and loss against the swept value."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ...metrics.runlog import write_json_atomic
from . import plot_section
from .answer import answer
from .levels import leveled
from ...metrics.runs import Bench, RecordedRun
from .setup import describe, not_comparable
from .table import default_target, markdown, row
from .tuned import Trial, add_tokens_to_target, best_cell, cells_of, check_targets, tuned_row, versus


def write_recipe_report(bench: Bench, out: Path, target_loss: float | None = None) -> list[dict]:
    """Write the report of a recipe bench into `out`; returns the tuned rows (one per variant,
    each with its targets checked)."""
    recipe = bench.meta["recipe"]
    variants, baseline = recipe["variants"], recipe["baseline"]
    runs = [e for e in bench.entries if isinstance(e, RecordedRun)]
    apart = not_comparable(runs)
    levels = any(leveled(r) for r in runs)

    def rows_at(target):
        return [_row(e, target, apart, levels) for e in bench.entries]

    trials = [Trial(m, e, r) for m, e, r in zip(bench.meta["runs"], bench.entries, rows_at(None))]
    grid = cells_of(trials)  # the best setting is chosen on final loss: the target does not enter
    best = {v["label"]: best_cell(grid.get(v["label"], [])) for v in variants}
    tuned_runs = [t.entry for c in best.values() if c for t in c.done if t.row["comparable"]]
    # As `lowcomm bench`: the worst final loss, here of the tuned runs, so each of them reaches it.
    target = next((t for t in (target_loss, recipe.get("target_loss")) if t is not None),
                  None) or default_target(tuned_runs)
    for t, r in zip(trials, rows_at(target)):
        t.row = r
    tuned = [tuned_row(v["label"], v["strategy"], best[v["label"]], len(grid.get(v["label"], [])), target)
             for v in variants]
    versus(tuned, baseline)
    for r, v in zip(tuned, variants):
        r["targets"] = check_targets(r, v.get("targets", {}))
    setting = describe(tuned_runs[0]) if tuned_runs else ""

    out.mkdir(parents=True, exist_ok=True)
    shown = [dataclasses.replace(c.done[0].entry, label=v) for v, c in best.items() if c]

    def draw():
        from .plots import write_plots
        from .sweep_plot import write_sweep_plot
        return write_plots(shown, out, target, setting) + write_sweep_plot(grid, best, out, setting)

    text = (f"# lowcomm bench: {Path(recipe['path']).name}\n\n" + answer(tuned, target, setting) + _by_tokens(tuned)
            + "\n\n"
            + _preamble(recipe, trials, grid) + "\n\n" + tuned_table(tuned, baseline) + "\n"
            + _missed(tuned) + "\n## Every setting tried\n\n" + grid_table(grid, best, variants)
            + "\n## Every run\n\n" + markdown([t.row for t in trials], target) + plot_section(draw))
    (out / "report.md").write_text(text)
    write_json_atomic(out / "report.json", {
        "target_loss": target, "setting": setting, "baseline": baseline, "recipe": recipe, "tuned": tuned,
        "grid": [c.as_json(c is best.get(v)) for v, cells in grid.items() for c in cells],
        "rows": [t.row for t in trials]})
    return tuned


def _row(entry, target, apart, levels) -> dict:
    r = row(entry, target, apart.get(entry.label), levels)
    return add_tokens_to_target(r, entry, target) if isinstance(entry, RecordedRun) else r


def _by_tokens(rows: list[dict]) -> str:
    """The answer's sentence on tokens: which variant, at its best setting, needs the fewest to the target."""
    reached = [r for r in rows if r["status"] == "ok" and r.get("comparable") and r["tokens_to_target"] is not None]
    if not reached:
        return ""
    fewest = min(reached, key=lambda r: r["tokens_to_target"])
    return f" Fewest tokens to it: **{fewest['label']}** ({fewest['tokens_to_target']:,.0f})."


def _preamble(recipe: dict, trials: list[Trial], grid: dict) -> str:
    failed = sum(not t.ok for t in trials)
    settings = sum(len(cells) for cells in grid.values())
    seeds = recipe["seeds"]
    return ((recipe.get("description", "") + "\n\n" if recipe.get("description") else "")
            + f"Recipe `{recipe['path']}`: {len(recipe['variants'])} variants, {settings} settings in all, "
            f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}): {len(trials)} runs"
            + (f", {failed} failed" if failed else "") + ". Each variant is compared at its own best setting: the "
            f"lowest validation loss, mean over seeds (ties: the shorter training time). Baseline: "
            f"{recipe['baseline']}.")


def tuned_table(rows: list[dict], baseline: str) -> str:
    head = ["variant", "best setting", "val loss: mean ± sd (min–max)", f"loss vs {baseline}", "bytes/token",
            f"bytes ÷ {baseline}", "tokens/s", f"tokens/s × {baseline}", "time to target (s)",
            "tokens to target", "MB to target", "targets"]
    compress = any(r.get("compress_pct") for r in rows)  # a column only where a variant compresses
    head[-1:-1] = ["compression % of step"] if compress else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        lost = f", {r['seeds_failed']} failed" if r["seeds_failed"] else ""
        loss = (f"{r['final_val_loss']:.4f} ± {r['final_val_loss_sd']:.4f} ({r['final_val_loss_min']:.4f}–"
                f"{r['final_val_loss_max']:.4f}, {r['seeds']} seeds{lost})" if r["seeds"] > 1
                else f"{r['final_val_loss']:.4f} (1 seed{lost})")
        cells = [r["label"] + ("" if r["comparable"] else " †"), _point(r["best"]), loss,
                 _opt(r["loss_vs_baseline"], "{:+.2%}"), f"{r['bytes_per_token']:,.1f}",
                 _bytes(r["bytes_vs_baseline"]), f"{r['tokens_per_s']:,.0f}", _opt(r["speed_vs_baseline"], "{:.2f}x"),
                 _opt(r["time_to_target_s"], "{:.1f}", "not reached"),
                 _opt(r["tokens_to_target"], "{:,.0f}", "not reached"),
                 _opt(r["mb_to_target"], "{:.2f}", "not reached"),
                 *([f"{r['compress_pct']:.1f}"] if compress else []),
                 ", ".join(("" if t["met"] else "**missed** ") + _target(t) for t in r["targets"]) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def grid_table(grid: dict, best: dict, variants: list[dict]) -> str:
    """Variants down, settings across: each cell's mean validation loss ± sd over its seeds, the best in bold."""
    columns = list(dict.fromkeys(_point(c.point) for cells in grid.values() for c in cells))
    lines = ["| variant | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for v in variants:
        by_point = {_point(c.point): c for c in grid.get(v["label"], [])}
        cells = []
        for col in columns:
            c = by_point.get(col)
            if c is None:
                cells.append("–")
            elif not c.done:
                cells.append("failed")
            else:
                losses = c.losses()
                sd = f" ± {c.as_json(False)['sd']:.4f}" if len(losses) > 1 else ""
                text = f"{sum(losses) / len(losses):.4f}{sd}" + (f" ({len(c.trials) - len(losses)} failed)"
                                                                   if len(losses) < len(c.trials) else "")
                cells.append(f"**{text}**" if c is best.get(v["label"]) else text)
        lines.append(f"| {v['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nFinal validation loss, mean ± sd over seeds; **bold**: the setting each " \
                              "variant is compared at.\n"


def _missed(rows: list[dict]) -> str:
    missed = [f"{r['label']}: {_target(t)}" for r in rows for t in r["targets"] if not t["met"]]
    return ("\nTargets missed: " + "; ".join(missed) + ".\n") if missed else ""


def _target(t: dict) -> str:
    words = {"max_loss_gap": ("loss gap", "≤", "{:+.2%}", "{:.2%}"), "max_val_loss": ("val loss", "≤", "{:.4f}", "{:g}"),
             "min_speedup": ("tokens/s ×", "≥", "{:.2f}", "{:g}"),
             "min_bytes_reduction": ("bytes reduction", "≥", "{:,.1f}x", "{:g}x")}
    name, sign, fmt, limit = words[t["target"]]
    value = fmt.format(t["value"]) if t["value"] is not None else "n/a"
    return f"{name} {value} ({sign} {limit.format(t['limit'])})"


def _point(point: dict) -> str:
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items()) or "as set"


def _opt(value, fmt: str, missing: str = "–") -> str:
    return fmt.format(value) if value is not None else missing


def _bytes(ratio) -> str:
    """bytes ÷ baseline, with how many times fewer beside it when fewer."""
    if ratio is None:
        return "–"
    return f"{ratio:.3g} ({1 / ratio:,.1f}x fewer)" if 0 < ratio < 1 else f"{ratio:.3g}"

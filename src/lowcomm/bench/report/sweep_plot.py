"""The sweep plot: final validation loss against a swept value (the lr, where it is swept),
one line per variant (and per setting of its other swept keys), the spread over seeds as
error bars from min to max, each variant's chosen setting starred."""
from __future__ import annotations

import textwrap
from pathlib import Path

from .plots import LOSS, MARKERS, STYLES, TITLE_CHARS


def swept_key(grid: dict) -> str | None:
    """The value on the x axis: lr when any variant sweeps it, else the first key swept over more than one value."""
    keys = [k for cells in grid.values() for k in _varying(cells)]
    for lr in ("lr", "optim.lr"):
        if lr in keys:
            return lr
    return keys[0] if keys else None


def _varying(cells) -> list[str]:
    return [k for k in (cells[0].point if cells else {}) if len({repr(c.point.get(k)) for c in cells}) > 1]


def write_sweep_plot(grid: dict, best: dict, out: Path, setting: str) -> list[Path]:
    """loss_vs_<key>.png, or nothing when no variant sweeps a value."""
    key = swept_key(grid)
    if key is None:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    values = [c.point[key] for cells in grid.values() for c in cells if key in c.point]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    order = sorted(set(values)) if numeric else list(dict.fromkeys(map(str, values)))
    line_no = 0
    for variant, cells in grid.items():
        lines: dict[str, list] = {}  # one line per setting of the variant's other swept keys
        for c in cells:
            if key in c.point and c.done:
                rest = ", ".join(f"{k}={v}" for k, v in c.point.items() if k != key)
                lines.setdefault(rest, []).append(c)
        for rest, line in lines.items():
            line.sort(key=lambda c: order.index(c.point[key] if numeric else str(c.point[key])))
            xs = [c.point[key] if numeric else order.index(str(c.point[key])) for c in line]
            stats = [c.as_json(False) for c in line]
            mean = [s["mean"] for s in stats]
            err = [[m - s["min"] for m, s in zip(mean, stats)], [s["max"] - m for m, s in zip(mean, stats)]]
            drawn = ax.errorbar(xs, mean, yerr=err, capsize=3, linestyle=STYLES[line_no % len(STYLES)],
                                marker=MARKERS[line_no % len(MARKERS)], markerfacecolor="none",
                                label=variant + (f" ({rest})" if rest else ""))
            for c, x, m in zip(line, xs, mean):
                if c is best.get(variant):
                    ax.plot([x], [m], marker="*", markersize=13, color=drawn.lines[0].get_color(),
                            markeredgecolor="black", markeredgewidth=0.6, linestyle="none", zorder=10)
            line_no += 1
    if numeric and min(order) > 0 and max(order) >= 3 * min(order):
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(range(len(order)), order)
    ax.set_xlabel(key + ("" if numeric else " (as swept)"))
    ax.set_ylabel("final " + LOSS)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, title="mean over seeds, bars min–max; ★ chosen", title_fontsize=8)
    fig.suptitle(f"Validation loss vs {key}\n{textwrap.fill(setting, TITLE_CHARS)}", fontsize=10)
    fig.tight_layout()
    path = out / f"loss_vs_{key.replace('.', '_')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

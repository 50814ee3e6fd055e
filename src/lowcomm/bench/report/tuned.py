"""A recipe's runs compared fairly: each variant at its own best setting of its grid, chosen
on validation loss (mean over seeds; ties, equal to 4 decimals, go to the shorter training
time), its spread over seeds, and its ratios to the baseline at the baseline's best setting.

Every grid cell is kept (`cells`), so report.json and the sweep plot show what was tried,
not only what won. A cell in which every seed failed cannot be chosen; one in which some
failed is chosen only on the seeds that finished, and says how many did.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ...metrics.runs import RecordedRun, reach

LOSS_DECIMALS = 4  # losses equal to this many decimals are a tie, decided by time
# Figures of a tuned row that are the mean of its seeds' (table.row keys, and two of ours).
MEANS = ("tokens", "tokens_planned", "wall_s", "tokens_per_s", "wire_mb_per_rank_per_step", "exposed_comm_pct",
         "optimizer_state_mb_per_rank", "peak_mem_mib", "bytes_per_token", "compress_pct")
TO_TARGET = ("time_to_target_s", "mb_to_target", "tokens_to_target")


@dataclass
class Trial:
    """One run of the grid: its bench.json record, what it left (RecordedRun, or Failed) and its table row."""
    meta: dict
    entry: object
    row: dict

    @property
    def ok(self) -> bool:
        return isinstance(self.entry, RecordedRun)


@dataclass
class Cell:
    """A variant at one setting of its grid, over its seeds."""
    variant: str
    point: dict
    trials: list[Trial] = field(default_factory=list)

    @property
    def done(self) -> list[Trial]:
        return [t for t in self.trials if t.ok]

    def losses(self) -> list[float]:
        return [t.row["final_val_loss"] for t in self.done]

    def time_s(self) -> float:
        return statistics.fmean(t.row["wall_s"] for t in self.done)

    def rank_key(self) -> tuple:
        return (round(statistics.fmean(self.losses()), LOSS_DECIMALS), self.time_s())

    def as_json(self, best: bool) -> dict:
        losses = self.losses()
        return {"variant": self.variant, "point": self.point, "best": best,
                "seeds": [t.meta.get("seed") for t in self.done],
                "failed_seeds": [t.meta.get("seed") for t in self.trials if not t.ok],
                "final_val_loss": losses, **spread(losses),
                "wall_s_mean": self.time_s() if losses else None,
                "runs": [t.meta["dir"] for t in self.trials]}


def spread(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "sd": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def cells_of(trials: list[Trial]) -> dict[str, list[Cell]]:
    """variant -> its grid cells, in the order they ran."""
    out: dict[str, list[Cell]] = {}
    for t in trials:
        cells = out.setdefault(t.meta["variant"], [])
        cell = next((c for c in cells if c.point == t.meta.get("point", {})), None)
        if cell is None:
            cell = Cell(t.meta["variant"], t.meta.get("point", {}))
            cells.append(cell)
        cell.trials.append(t)
    return out


def best_cell(cells: list[Cell]) -> Cell | None:
    finished = [c for c in cells if c.done]
    return min(finished, key=Cell.rank_key) if finished else None


def tuned_row(variant: str, strategy: str, cell: Cell | None, tried: int, target: float | None) -> dict:
    """The variant at its best cell: the table.row figures averaged over its seeds, the loss's spread."""
    if cell is None:
        return {"label": variant, "status": "failed", "strategy": strategy,
                "error": f"all {tried} of its runs failed (see the runs' table)"}
    done = cell.done
    rows = [t.row for t in done]
    out = {"label": variant, "status": "ok", "strategy": strategy, "best": cell.point,
           "seeds": len(done), "seeds_failed": len(cell.trials) - len(done), "settings_tried": tried,
           "comparable": all(r["comparable"] for r in rows),
           "not_comparable": sorted({w for r in rows for w in r["not_comparable"]})}
    out |= {k: statistics.fmean(r[k] for r in rows) for k in MEANS}
    out["tokens"], out["tokens_planned"] = round(out["tokens"]), round(out["tokens_planned"])
    loss = spread(cell.losses())
    out |= {"final_val_loss": loss["mean"], "final_val_loss_sd": loss["sd"], "final_val_loss_min": loss["min"],
            "final_val_loss_max": loss["max"]}
    out |= conditions(rows)
    for k in TO_TARGET:  # reached by every seed, or not reached
        values = [r[k] for r in rows]
        out[k] = statistics.fmean(values) if target is not None and None not in values else None
    return out


def conditions(rows: list[dict]) -> dict:
    """The load its seeds ran at, for the answer's check of a ranking by time (bench/report/conditions.py):
    the mean load and the geometric mean contention over the seeds (None where one recorded none)."""
    loads, contentions = [r.get("load") for r in rows], [r.get("contention") for r in rows]
    if None in loads or None in contentions:
        return {"load": None, "cores": None, "contention": None}
    return {"load": statistics.fmean(loads), "cores": rows[0]["cores"],
            "contention": statistics.geometric_mean(contentions)}


def add_tokens_to_target(row: dict, entry: RecordedRun, target: float | None) -> dict:
    """table.row's figures, and those a tuned comparison needs beside them."""
    s = entry.summary
    row["bytes_per_token"] = s.get("wire_bytes_total", 0) / max(s["tokens"], 1)
    # CPU time compressing and decompressing, as a share of a step (strategies that compress report it)
    row["compress_pct"] = 100 * s.get("compress_s_per_step", 0.0) * s["steps"] / s["wall_s"] if s["wall_s"] else 0.0
    row["tokens_to_target"] = reach(entry.curve, target, "tokens") if target is not None else None
    return row


def versus(rows: list[dict], baseline: str) -> None:
    """Each tuned row against the baseline's: loss gap, bytes ratio, speed ratio (None without one)."""
    base = next((r for r in rows if r["label"] == baseline and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] != "ok" or base is None:
            r.update(loss_vs_baseline=None, bytes_vs_baseline=None, speed_vs_baseline=None)
            continue
        r["loss_vs_baseline"] = r["final_val_loss"] / base["final_val_loss"] - 1
        r["bytes_vs_baseline"] = r["bytes_per_token"] / base["bytes_per_token"] if base["bytes_per_token"] else None
        r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]


def check_targets(row: dict, targets: dict[str, float]) -> list[dict]:
    """Each target of the variant with its figure and whether it is met (a failed variant meets none)."""
    ratio = row.get("bytes_vs_baseline")
    figure = {"max_loss_gap": row.get("loss_vs_baseline"), "max_val_loss": row.get("final_val_loss"),
              "min_speedup": row.get("speed_vs_baseline"),
              "min_bytes_reduction": None if ratio is None else 1 / ratio if ratio else float("inf")}
    out = []
    for name, limit in targets.items():
        value = figure[name]
        met = value is not None and (value <= limit if name.startswith("max") else value >= limit)
        out.append({"target": name, "limit": limit, "value": value, "met": met})
    return out

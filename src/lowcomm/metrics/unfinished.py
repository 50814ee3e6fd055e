"""A run that did not finish: stopped (--stop-at), killed or crashed before it wrote summary.json.

What it did write -- config.toml before its workers started, steps.jsonl one step at a time --
still holds its loss curve, its bytes and waits, and with --score every scored round. So
`lowcomm report` reads such a run with a summary made from those two files: the totals
steps.jsonl sums to (tokens, bytes, exposed seconds, each rank's compute; the wall time is the
summed step times, evaluation excluded, as the report's curves count it) and the options
config.toml names; what only the run's end measures is None (UNKNOWN), shown as unknown, and the
run is left out of the target and the answer (`finished` False).
"""
from __future__ import annotations

from .summary import Totals

# summary.json's figures that only the run's end measures: its final evaluation, its wall clock
# (tokens/s is over it, evaluation included), its memory and optimizer state, the machine's load.
UNKNOWN = ("final_train_loss", "final_val_loss", "tokens_per_s", "optimizer_state_bytes_per_rank",
           "peak_mem_bytes", "params")


def summary_from_log(steps: list[dict], config: dict) -> dict:
    """A summary.json-shaped dict for the run that logged `steps` under `config` (config.toml read
    back), with `finished` False, `steps` the last step logged and `steps_planned` its --steps."""
    workers = int(config.get("workers") or 1)
    totals = Totals(workers)
    for record in steps:
        totals.add(record)
    done = steps[-1]["step"] if steps else 0
    wall = sum(rec["wall_s"] for rec in steps)
    strategy = config["strategy"]
    options = config.get(strategy, {})
    link = config.get("link") or {}
    return {
        **dict.fromkeys(UNKNOWN),
        "finished": False, "strategy": strategy, "strategy_options": options, "workers": workers,
        "steps": done, "steps_planned": config.get("steps", done), "tokens": totals.tokens, "wall_s": wall,
        "wire_bytes_total": totals.wire, "wire_bytes_per_rank_per_step": totals.wire / max(done, 1) / workers,
        "exposed_comm_s": totals.exposed, "exposed_comm_fraction": totals.exposed / wall if wall > 0 else 0.0,
        "compute_s_per_rank": totals.compute_per_rank, "exposed_comm_s_per_rank": totals.exposed_per_rank,
        "micro_batches_per_rank": totals.micro_per_rank,
        "model": config.get("model", {}).get("preset", "?"), "data": config.get("data", {}).get("source", "?"),
        "link": link if link.get("bandwidth") else None,
        **untrusted_options(options),
    }


def untrusted_options(options: dict) -> dict:
    """--attack, --attackers and --aggregate as summary.json names them (metrics.summary.describe_untrusted);
    the scored rounds are on steps.jsonl's records, where the report reads them."""
    attack = str(options.get("attack", "none"))
    if "aggregate" not in options:  # a strategy without an outer step to defend
        return {}
    attackers = [int(r) for r in str(options.get("attackers", "")).split(",") if r.strip()]
    return {"aggregate": options["aggregate"], **({"attack": attack, "attackers": attackers}
                                                   if attack != "none" and attackers else {})}

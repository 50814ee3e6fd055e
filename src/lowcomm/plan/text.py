"""How `lowcomm plan` prints: its table of strategies, the replica counts it tried, and the
column layout every plan table shares (plan_tune's too)."""
from __future__ import annotations

from .. import config as C


def plan_table(ranked, cluster, cfg, target, left_out: dict) -> str:
    from .planner import format_seconds as _s
    grouped = not cluster.flat
    head = (f"{cluster.params / 1e6:,.1f}M params on {cluster.workers} workers"
            + (f" as {cluster.groups} replicas of {cluster.workers // cluster.groups} ({cfg.inside} inside)"
               if grouped else "")
            + f", {cluster.tokens_per_step:,} tokens per step, {links(cfg, grouped)}"
            + (f", slowdown up to {cluster.slowest:g}x" if cluster.slowdown else "") + "\n\n")
    wire = ["intra MB/step/rank", "cross MB/step/rank"] if grouped else ["wire MB/step/rank"]
    cols = ["#", "strategy", "step", "compute", "exposed comm", "tokens/s", "bytes/token", *wire,
            "memory/worker"] + (["time to target"] if any(p.time_to_target_s is not None for p in ranked) else [])
    rows = []
    for i, p in enumerate(ranked, 1):
        per_rank = ([p.levels[level]["wire_bytes_per_rank_per_step"] for level in ("intra", "cross")] if grouped
                    else [p.wire_bytes_per_rank_per_step])
        row = [str(i), p.label, _s(p.step_s), _s(p.compute_s), f"{_s(p.exposed_comm_s)} ({100 * p.exposed_fraction:.0f}%)",
               f"{p.tokens_per_s:,.0f}", f"{p.bytes_per_token:,.3g}", *(f"{b / 1e6:,.3g}" for b in per_rank),
               f"{p.model_state_bytes / 2**30:,.2f} GiB" if p.model_state_bytes >= 2**30
               else f"{p.model_state_bytes / 2**20:,.1f} MiB"]
        if len(cols) > len(row):
            row.append(_s(p.time_to_target_s) if p.time_to_target_s is not None else "-")
        rows.append(row)
    note = ("\nmemory: parameters, gradients and optimizer state (activations excluded)"
            + (f"; target loss {target:.4f}" if target is not None and cols[-1] == "time to target" else ""))
    if grouped:
        note += ("\nintra/cross MB/step/rank: what a rank sends inside its replica and across replicas (averaged "
                 "over the positions of a replica); bytes/token: both levels, all ranks; exposed comm: the inside "
                 "collectives in full, plus what the strategy leaves exposed across")
    note += "".join(defence_line(p) for p in ranked if p.defence)
    if left_out:
        note += "\nnot planned here: " + "; ".join(f"{name} ({why})" for name, why in left_out.items())
    return head + columns(cols, rows) + note


def counts_table(best, workers: int) -> str:
    """Each replica count's fastest strategy (lowcomm plan --intra-link without --replicas)."""
    from .planner import format_seconds as _s
    cols = ["R", "K", "fastest", "step", "tokens/s", "intra bytes/token", "cross bytes/token"]
    rows = [[str(p.replicas), str(workers // p.replicas), p.label, _s(p.step_s), f"{p.tokens_per_s:,.0f}",
             f"{p.levels['intra']['bytes_per_token']:,.3g}", f"{p.levels['cross']['bytes_per_token']:,.3g}"]
            for p in best]
    return (f"replica counts tried (R replicas of K = {workers}/R workers each; R = {workers} is flat):\n"
            + columns(cols, rows))


def links(cfg, grouped: bool) -> str:
    spec = link_specs(cfg)
    return (f"link {spec['link']} across replicas, intra-link {spec['intra_link']} inside" if grouped
            else f"link {spec['link']}")


def columns(cols: list[str], rows: list[list[str]]) -> str:
    """`rows` under `cols`, each column as wide as its widest cell."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def link_specs(cfg: C.RunConfig) -> dict[str, str]:
    """--link and --intra-link as a reader writes them ('100mbit,10ms'), 'none' where unshaped."""
    links = C.to_dict(cfg)
    return {k: links[k]["bandwidth"] + "," + links[k]["latency"] if links[k]["bandwidth"] else "none"
            for k in ("link", "intra_link")}


def defence_line(p) -> str:
    """What a prediction's untrusted-workers defence costs a worker (robust/costs.py), one line."""
    from .planner import FLOPS_PER_BYTE, format_seconds as _s
    d = p.defence
    every = "a step" if d["syncs_per_step"] >= 1 else f"a sync (every {1 / d['syncs_per_step']:g} steps)"
    score = f"; scoring {_s(d['score_flops'] / d['flops_per_s'])}" if d["score_flops"] else ""
    return (f"\ndefence, {p.label}: holds every worker's contribution ({d['held_bytes'] / 2**30:,.3g} GiB, in "
            f"memory/worker); its aggregate moves {d['moved_bytes'] / 1e9:,.3g} GB of memory, "
            f"{_s(d['moved_bytes'] / d['memory_bytes_per_s'])} at {d['memory_bytes_per_s'] / 1e9:,.0f} GB/s (FLOP/s "
            f"/ {FLOPS_PER_BYTE:g}){score}, {every}: {_s(p.defence_s)} a step, in its step time")

"""Run totals, summary.json's contents, and the one-paragraph summary printed at the end of a run."""
from __future__ import annotations

from .levels import LEVEL_WORDS, LEVELS, has_levels, level_figures
from ..strategies import registry


class Totals:
    """Sums over the merged step records (metrics/runlog.py step_record)."""

    def __init__(self, world: int):
        self.tokens = 0
        self.wire = 0
        self.exposed = 0.0  # per step, the slowest rank's wait
        self.compute_per_rank = [0.0] * world
        self.exposed_per_rank = [0.0] * world
        self.micro_per_rank = [0] * world
        self.levels: dict[str, list[float]] = {}  # level -> [wire bytes, exposed s]: a run with replicas
        # the train loss from a step that sent across (an outer step, in the local-SGD family) to
        # the next, where it rose most and the last time: {"step", "loss_before", "loss_after"}
        self.rise_after_sending: dict | None = None
        self.last_after_sending: dict | None = None
        self._before: tuple | None = None  # the previous record's (step, loss, whether it sent across)

    def add(self, record: dict) -> None:
        self._note_rise(record)
        self.tokens += record["tokens"]
        for level in LEVELS:
            if f"wire_bytes_{level}" in record:
                sums = self.levels.setdefault(level, [0, 0.0])
                sums[0] += record[f"wire_bytes_{level}"]
                sums[1] += record[f"exposed_comm_s_{level}"]
        self.wire += record["wire_bytes"]
        self.exposed += record["exposed_comm_s"]
        # Per worker: an elastic run's record names the slot of each of its ranks ("members"; a
        # joiner's slot is past the run's first workers), a plain run's ranks are its workers.
        per_rank = record["per_rank"]
        slots = record.get("members") or range(len(per_rank["micro_batches"]))
        for name in ("compute_per_rank", "exposed_per_rank", "micro_per_rank"):
            values = getattr(self, name)
            values.extend([0] * (max(slots, default=-1) + 1 - len(values)))
        for r, slot in enumerate(slots):
            self.compute_per_rank[slot] += per_rank["compute_s"][r]
            self.exposed_per_rank[slot] += per_rank["exposed_comm_s"][r]
            self.micro_per_rank[slot] += per_rank["micro_batches"][r]

    def _note_rise(self, record: dict) -> None:
        """A local-SGD run's outer step moves the model the next step trains from: how far the
        train loss rose across one (0 bytes across: the workers trained on their own)."""
        loss = record.get("loss")
        if self._before is not None and self._before[2] and loss is not None:
            step, before, _ = self._before
            best, self.last_after_sending = self.rise_after_sending, {"step": step, "loss_before": before,
                                                                      "loss_after": loss}
            if best is None or loss - before > best["loss_after"] - best["loss_before"]:
                self.rise_after_sending = self.last_after_sending
        sent = record.get("wire_bytes_cross", record["wire_bytes"]) > 0
        self._before = (record["step"], loss, sent) if loss is not None else None

    def per_level(self, steps: int, elapsed_s: float) -> dict[str, tuple[float, float]]:
        """level -> (MB per step, all ranks; share of `elapsed_s` waited, the slowest rank's per
        step as for `exposed`), for the progress line; {} for a flat run."""
        return {level: (wire / 1e6 / max(steps, 1), exposed / elapsed_s)
                for level, (wire, exposed) in self.levels.items()}


def build_summary(cfg, *, world: int, backend: str, params: int, source: str, totals: Totals,
                  train_loss: float, val_loss: float, wall_s: float, optimizer_state_bytes: int,
                  peak_mem_bytes: int, link: dict | None, link_times, traced: bool,
                  strategy_report: dict, plan: list, planned_wire_bytes: int) -> dict:
    """summary.json. `link_times` is a (W, 3) tensor of each rank's comm busy,
    emulated and slowdown-sleep seconds; `link` the LinkModel's description; `plan`
    the strategy's declared communication plan and `planned_wire_bytes` what it
    predicts for this run, all ranks (to set beside the counted wire_bytes_total)."""
    from ..config import to_dict
    shown = to_dict(cfg)
    busy = float(link_times[:, 0].sum())
    stragglers = cfg.stragglers
    return {
        "strategy": cfg.strategy,
        "strategy_options": shown.get(cfg.strategy, {}),
        "workers": world,
        "backend": backend,
        "precision": cfg.precision,  # --precision: the forward/backward's autocast (what is sent stays fp32)
        "model": cfg.model.preset,
        "steps": cfg.steps,
        "params": params,
        "tokens": totals.tokens,
        "final_train_loss": train_loss,
        "final_val_loss": val_loss,
        "wall_s": wall_s,
        "tokens_per_s": totals.tokens / wall_s,
        "wire_bytes_total": totals.wire,
        "planned_wire_bytes_total": planned_wire_bytes,
        "comm_plan": [{"collective": op.collective, "bytes": op.nbytes, "every": op.every,
                       "offset": op.offset, "what": op.what} for op in plan],
        "wire_bytes_per_step": totals.wire / cfg.steps,
        "wire_bytes_per_rank_per_step": totals.wire / cfg.steps / world,
        "exposed_comm_s": totals.exposed,
        "exposed_comm_fraction": totals.exposed / wall_s,
        "compute_s_per_rank": totals.compute_per_rank,
        "micro_batches_per_rank": totals.micro_per_rank,
        "optimizer_state_bytes_per_rank": optimizer_state_bytes,
        "peak_mem_bytes": peak_mem_bytes,
        "data": source,
        # -- emulated network and workers --
        "link": {**shown["link"], **link} if link is not None else None,
        "slowdown": list(cfg.slowdown) or [1.0] * world,
        "stragglers": {"prob": stragglers[0], "factor": stragglers[1]} if stragglers and stragglers[0] > 0 else None,
        "slowdown_sleep_s_per_rank": link_times[:, 2].tolist(),
        "exposed_comm_s_per_rank": totals.exposed_per_rank,
        "exposed_comm_fraction_per_rank": [e / wall_s for e in totals.exposed_per_rank],
        "comm_s_per_rank": link_times[:, 0].tolist(),
        "comm_emulated_s_per_rank": link_times[:, 1].tolist(),
        # share of communication time (ops in flight, all ranks) that only the emulator added
        "comm_modeled_share": float(link_times[:, 1].sum()) / busy if busy > 0 else 0.0,
        "trace": "trace.json" if traced else None,
        **strategy_report,
        # the local-SGD family (outer syncs): validation sees the model its last outer step made
        **({"rise_after_outer_step": totals.rise_after_sending, "last_after_outer_step": totals.last_after_sending}
           if "outer_syncs" in strategy_report else {}),
        "notes": _notes(cfg, backend, plan, totals, planned_wire_bytes),
    }


def _notes(cfg, backend: str, plan: list, totals: Totals, planned_wire_bytes: int) -> list[str]:
    """What a reader of the byte counts needs told: gloo's reduce_scatter, and counted bytes above
    the plan (an adaptive strategy computing more micro-batches than --accum, each of which costs
    the collectives of the engine inside a replica: FSDP's gathers and reduce-scatters)."""
    notes = []
    if backend == "gloo" and any(op.collective == "reduce_scatter" for op in plan):
        notes.append("wire bytes follow the ring model of ALGORITHMS.md; on gloo a reduce_scatter runs as a full "
                     "all-reduce, so its real transport is twice the counted bytes")
    planned_micro = cfg.steps * cfg.accum * registry.get(cfg.strategy).micro_batch_parts + 1  # + a start-up one
    if totals.wire > planned_wire_bytes and max(totals.micro_per_rank, default=0) > planned_micro:
        notes.append(f"{(totals.wire - planned_wire_bytes) / 1e6:,.2f} MB were sent beyond the plan, which assumes "
                     f"--accum micro-batches a step: adaptive rounds computed more (micro-batches per rank: "
                     f"{', '.join(map(str, totals.micro_per_rank))}), each with the collectives of the engine "
                     f"inside its replica")
    return notes


def describe(s: dict) -> str:
    """The one-paragraph summary printed at the end of a run."""
    return (f"{s['strategy']} on {s['workers']} worker(s): {s['steps']} steps, {s['tokens']:,} tokens in "
            f"{s['wall_s']:.1f} s ({s['tokens_per_s']:,.0f} tok/s). {_describe_losses(s)} Sent {s['wire_bytes_total'] / 1e6:,.1f} MB over all ranks "
            f"({s['wire_bytes_per_rank_per_step'] / 1e6:,.2f} MB per rank per step); waited on the network "
            f"{100 * s['exposed_comm_fraction']:.1f}% of the wall time. Optimizer state "
            f"{s['optimizer_state_bytes_per_rank'] / 1e6:,.2f} MB per rank, peak memory "
            f"{s['peak_mem_bytes'] / 2**20:,.0f} MiB." + _describe_levels(s) + _describe_emulation(s))


def _describe_losses(s: dict) -> str:
    """The final losses; in the local-SGD family, which model each is of: the train loss is the
    workers' own models' on the last step, the validation the global model the run's last outer
    step (at that step) made, and how far an outer step moved the model where the loss says so."""
    train, val = f"Final train loss {s['final_train_loss']:.4f}", f"validation loss {s['final_val_loss']:.4f}"
    if not s.get("outer_syncs"):
        return f"{train}, {val}."
    text = (f"{train} (the workers' own models on the last step, before its outer step), {val} (the global "
            f"model, measured right after that outer step moved it")
    rise, last = s.get("rise_after_outer_step"), s.get("last_after_outer_step")
    if rise and rise["loss_after"] > rise["loss_before"]:
        text += (f"; the outer step after step {rise['step']} raised the train loss most, from "
                 f"{rise['loss_before']:.2f} to {rise['loss_after']:.2f}")
        if last and last["step"] != rise["step"]:
            text += (f"; across the last one, after step {last['step']}, it went from {last['loss_before']:.2f} "
                     f"to {last['loss_after']:.2f}")
    text += ")"
    return text + "."


def _describe_levels(s: dict) -> str:
    """With replica groups, each level's share: the slow link's bytes are the ones that matter."""
    if not has_levels(s):
        return ""
    parts = [f"{LEVEL_WORDS[level]} {s['levels'][level]['wire_bytes'] / 1e6:,.2f} MB ({per_token:,.1f} bytes "
             f"per token), waited {100 * waited / s['wall_s']:.1f}%"
             for level, (per_token, waited) in level_figures(s).items()]
    return f" By level ({s['replicas']} replicas of {s['workers'] // s['replicas']}; waits: mean over ranks): " + \
        "; ".join(parts) + "."


def _describe_emulation(s: dict) -> str:
    """Says which part of the timing was emulated, so no one mistakes it for a real network."""
    text = ""
    if s.get("link"):
        ln = s["link"]
        text += (f" Link emulated at {ln['bandwidth']}, {ln['latency']} per hop: "
                 f"{100 * s['comm_modeled_share']:.0f}% of communication time was modeled.")
    if any(f != 1.0 for f in s.get("slowdown") or []) or s.get("stragglers"):
        text += f" Emulated slow workers: slept {sum(s['slowdown_sleep_s_per_rank']):.1f} s in total."
    if s.get("trace"):
        text += f" Trace: {s['trace']} (open in ui.perfetto.dev)."
    return text + describe_untrusted(s)


def describe_untrusted(s: dict) -> str:
    """--attack, --aggregate and --score (docs/untrusted.md): who attacked, how the outer steps
    combined the workers, and whom scoring left out (when first, in how many rounds)."""
    who = "replica" if s.get("inside") else "worker"  # across replica groups (an engine inside) a replica is one worker
    text = f" Emulated attack {s['attack']} by {who}(s) {', '.join(map(str, s['attackers']))}." \
        if s.get("attack") else ""
    if s.get("aggregate", "mean") != "mean":
        text += f" Outer steps aggregated by {s['aggregate']}."
    rounds = s.get("score_rounds")
    if rounds:
        out = sorted({r for k in rounds for r in k["left_out"]})
        said = [f"{who} {r} in {sum(r in k['left_out'] for k in rounds)} of {len(rounds)} rounds (first at round "
                f"{next(k['round'] for k in rounds if r in k['left_out'])})" for r in out]
        text += f" Scoring left out {'; '.join(said)}." if said else \
            f" Scoring left nobody out in {len(rounds)} round{'s' * (len(rounds) != 1)}."
    return text

"""Run totals and the one-paragraph summary printed at the end of a run."""
from __future__ import annotations


class Totals:
    """Sums over the merged step records (metrics/runlog.py step_record)."""

    def __init__(self, world: int):
        self.tokens = 0
        self.wire = 0
        self.exposed = 0.0  # per step, the slowest rank's wait
        self.compute_per_rank = [0.0] * world
        self.exposed_per_rank = [0.0] * world
        self.micro_per_rank = [0] * world

    def add(self, record: dict) -> None:
        self.tokens += record["tokens"]
        self.wire += record["wire_bytes"]
        self.exposed += record["exposed_comm_s"]
        per_rank = record["per_rank"]
        for r in range(len(self.compute_per_rank)):
            self.compute_per_rank[r] += per_rank["compute_s"][r]
            self.exposed_per_rank[r] += per_rank["exposed_comm_s"][r]
            self.micro_per_rank[r] += per_rank["micro_batches"][r]


def describe(s: dict) -> str:
    """The one-paragraph summary printed at the end of a run."""
    return (f"{s['strategy']} on {s['workers']} worker(s): {s['steps']} steps, {s['tokens']:,} tokens in "
            f"{s['wall_s']:.1f} s ({s['tokens_per_s']:,.0f} tok/s). Final train loss {s['final_train_loss']:.4f}, "
            f"validation loss {s['final_val_loss']:.4f}. Sent {s['wire_bytes_total'] / 1e6:,.1f} MB over all ranks "
            f"({s['wire_bytes_per_rank_per_step'] / 1e6:,.2f} MB per rank per step); waited on the network "
            f"{100 * s['exposed_comm_fraction']:.1f}% of the wall time. Optimizer state "
            f"{s['optimizer_state_bytes_per_rank'] / 1e6:,.2f} MB per rank, peak memory "
            f"{s['peak_mem_bytes'] / 2**20:,.0f} MiB." + _describe_emulation(s))


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
    return text

"""Ring-model wire bytes and latency hops of each collective (ALGORITHMS.md).

`nbytes` is S in the table: the full logical tensor for all_reduce, the full
input for reduce_scatter, the full gathered output for all_gather, the tensor
for broadcast and the full send buffer for all_to_all. The same formulas drive
the link emulator and the planner, so they can never disagree on what a byte
costs.
"""
from __future__ import annotations

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


def wire_bytes(op: str, nbytes: int, world: int) -> int:
    """Bytes one rank sends for `op` on a ring of `world` ranks."""
    if world <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (world - 1) * nbytes // world
    if op == "broadcast":
        return nbytes
    raise ValueError(f"unknown collective '{op}'")


def latency_hops(op: str, world: int) -> int:
    """Sequential message latencies `op` pays on a ring."""
    if world <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (world - 1)
    if op in ("reduce_scatter", "all_gather"):
        return world - 1
    if op in ("broadcast", "all_to_all"):
        return 1
    raise ValueError(f"unknown collective '{op}'")

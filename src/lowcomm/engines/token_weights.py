"""Token-weighted outer merges (Decoupled DiLoCo, Douillard et al. 2025): with
`--outer-weights tokens`, an outer sync averages the pseudo-gradients of the workers present
weighted by the tokens each trained since its last sync,

    Δ = Σ_r (t_r / Σ_s t_s) Δ_r

so a worker that joined mid-round, or whose inner steps were skipped (non-finite), counts for
what it trained; one that trained nothing counts for nothing. When every worker trained the same
tokens, the weights are exactly 1/W and the merge is bit for bit the equal-weight one.

The tokens travel as the first number of the step info beside each Δ_r: an all_gather of
8 bytes a rank before the summing all-reduce (each rank must know its weight before it scales
its Δ_r), inside the all-gathered payload for int8/int4/compressed outer gradients.
"""
from __future__ import annotations

import torch

WEIGHTS = ("equal", "tokens")
TOKEN_BYTES = 8  # float64 a rank, the all-reduce path's extra all_gather


def token_weights(tokens: torch.Tensor) -> torch.Tensor:
    """w_r = t_r / Σ t: exactly 1/W when all are equal (or none trained), float64."""
    tokens = tokens.double()
    W = tokens.numel()
    if bool((tokens == tokens[0]).all()) or float(tokens.sum()) <= 0:
        return torch.full((W,), 1.0 / W, dtype=torch.float64)
    return tokens / tokens.sum()


def contribution(tokens: torch.Tensor | None) -> dict | None:
    """What steps.jsonl records of an outer sync: how many workers contributed, and the tokens."""
    if tokens is None or tokens.numel() == 0:
        return None
    per = [int(t) for t in tokens.tolist()]
    return {"contributors": sum(1 for t in per if t > 0), "tokens": sum(per), "tokens_per_member": per}


def trained_rows(tokens: torch.Tensor | None, n: int) -> torch.Tensor:
    """Which of `n` gathered rows come from a rank that trained since the last sync (tokens > 0;
    None: every one), or every row where none did (each zero, as the token weights count them)."""
    trained = tokens.cpu() > 0 if tokens is not None else torch.ones(n, dtype=torch.bool)
    return trained if trained.any() else torch.ones(n, dtype=torch.bool)

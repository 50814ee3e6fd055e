"""Gauntlet's probe (robust/scoring.py has the rule): the loss change one contribution causes on
held sequences, whatever the strategy's step is made of. The caller says how contribution r moves
the model (`move(r)`: θ − 0.2·lr·Δ_r on the outer-sync engine, θ − 0.2·lr·sign(Q_r) for DeMo)
and the context the probes run in (`around()`: θ in the model, and the model as it was after);
this module runs the forwards and turns them into gains.

    gains = probe_gains(model, held, batches, mine, world, move, around)
    # per r in mine: [Gauntlet's score, own data's relative gain, random data's relative gain]
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn as nn

from .scoring import HeldBatch, next_token_loss


@torch.no_grad()
def probe_gains(model: nn.Module, held: HeldBatch, batches: torch.Tensor, mine: list[int], world: int,
                move: Callable[[int], None], around: Callable[[], ContextManager] = nullcontext,
                pooled: Callable[[list[float]], list[float]] | None = None) -> list[list[float]]:
    """(Gauntlet's score, own data's relative improvement, random data's) of each contribution in
    `mine`, contribution r on its own batch (batches[r]) and the next worker's ((r + 1) mod
    `world`, data r was not given). Inside `around()` (entered only where there is work) the model
    holds θ; `move(r)` writes θ moved by contribution r into it (from θ, not from the previous
    probe), and leaving `around()` puts back what the model held before. The forwards are not
    training: the held batch is paused and the model in eval mode (no dropout: a score does not
    depend on a draw, nor draws from the run's generator). `pooled` (across replica groups): every
    loss of the round, in one list, to the replica's mean of each. No sequence held (batches
    [W, 0, 0]): every score is 0."""
    if not mine or batches.numel() == 0 or batches.shape[2] < 2:
        return [[0.0, 0.0, 0.0] for _ in mine]
    pairs = {r: (r, (r + 1) % world) for r in mine}  # (own, random)
    needed = sorted({b for pair in pairs.values() for b in pair})
    held.paused, training = True, model.training
    model.eval()
    try:
        with around():
            losses = [next_token_loss(model, batches[b]) for b in needed]  # the loss at θ
            for r in mine:
                move(r)
                losses += [next_token_loss(model, batches[b]) for b in pairs[r]]
    finally:
        held.paused = False
        model.train(training)
    losses = pooled(losses) if pooled is not None else losses
    base = dict(zip(needed, losses))
    out = []
    for k, r in enumerate(mine):
        after = losses[len(needed) + 2 * k:len(needed) + 2 * k + 2]
        gain = [(base[b] - a) / base[b] if base[b] > 0 else 0.0 for b, a in zip(pairs[r], after)]
        out.append([gain[1], gain[0], gain[1]])
    return out

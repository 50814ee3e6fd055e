"""Gauntlet's probe (robust/scoring.py has the rule): the losses one contribution's step causes on
held sequences, whatever the strategy's step is made of. The caller says how contribution r moves
the model (`move(r)`: θ − 0.2·lr·Δ_r on the outer-sync engine, θ − 0.2·lr·sign(Q_r) for DeMo)
and the context the probes run in (`around()`: θ in the model, and the model as it was after);
this module runs the forwards.

    base, after = probe_losses(model, held, batches, bases, mine, world, move, around)
    # base: the loss at θ of each batch in `bases`; after: per r in mine, (own batch's, random one's)
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn as nn

from .scoring import HeldBatch, next_token_loss


@torch.no_grad()
def probe_losses(model: nn.Module, held: HeldBatch, batches: torch.Tensor, bases: list[int], mine: list[int],
                 world: int, move: Callable[[int], None], around: Callable[[], ContextManager] = nullcontext,
                 pooled: Callable[[list[float]], list[float]] | None = None
                 ) -> tuple[list[float], list[tuple[float, float]]]:
    """This validator's share of the round's losses (robust/scoring.py turns them into scores): the
    loss at θ of each batch in `bases` (batches[b]: worker b's held sequences), and for each
    contribution r in `mine` the loss of its own batch and of the next worker's ((r + 1) mod
    `world`, data r was not given) once `move(r)` wrote θ moved by r into the model (from θ, not
    from the previous probe). Inside `around()` (entered only where there is work) the model holds
    θ; leaving it puts back what the model held before. The forwards are not training: the held
    batch is paused and the model in eval mode (no dropout: a score does not depend on a draw,
    nor draws from the run's generator). `pooled` (across replica groups): every loss, in one
    list, to the replica's mean of each. No sequence held (batches [W, 0, 0]): every loss 0."""
    if not mine or batches.numel() == 0 or batches.shape[2] < 2:
        return [0.0] * len(bases), [(0.0, 0.0)] * len(mine)
    held.paused, training = True, model.training
    model.eval()
    try:
        with around():
            losses = [next_token_loss(model, batches[b]) for b in bases]  # at θ
            for r in mine:
                move(r)
                losses += [next_token_loss(model, batches[b]) for b in (r, (r + 1) % world)]
    finally:
        held.paused = False
        model.train(training)
    losses = pooled(losses) if pooled is not None else losses
    after = losses[len(bases):]
    return losses[:len(bases)], [(after[2 * k], after[2 * k + 1]) for k in range(len(mine))]

"""--score on a strategy that gathers every worker's payload itself at every step (DeMo, through
robust/gathered.py): the outer-sync engine's scored round (outer_scoring.py: the held sequences
shared, one validator per contribution, one all-reduce of the table, Scoreboard.judge) on every
--score-every'th step (optimizer steps 0, N, 2N, ...), on each sender's payload decoded alone.
Between scored steps the last round's decision holds: the workers it left out, and those it
named replaying (a zero, a stale one), stay out of the aggregate until the next scored round says
otherwise; equal payloads (a copy) are taken once at every step (robust/gathered.py). Scoring
every step would cost each validator three forwards a step.

The probe is the strategy's own step: DeMo applies θ − lr·sign(Q), so contribution r is probed at
θ − 0.2·lr·sign(Q_r), Q_r its sender's payload decoded alone, each tensor at its param group's lr
of the step (weight decay left out: it is the same for every contribution). That is how Covenant's
validator applied a peer's DeMo gradient while templar trained with DeMo: one-covenant/templar
neurons/validator.py decoded the peer's DCT top-k (transformer.decode(compressor.decompress(...)))
and stepped p.data.sub_(grad.sign(), alpha=lr) from commit 0cde3fe2 ("scoring logic", 2025-02-02;
the raw decoded gradient at lr before, 7b289c8a), at lr × eval_lr_factor (0.2 in hparams.json)
from ab4a36a1 (2025-04-17). A sign sees no scale: scale:K with K > 0 probes as the honest row (its
harm is to the mean's sign, which a robust --aggregate takes away) and scale:-K as a sign flip;
median-norm-clip's clip keeps every sign, so the probe is the row as that merge takes it.

The held sequences scored on are those of the scored step itself (the held batch is taken anew
at the end of the step before), as Gauntlet scores a gradient on the data it was computed from.
A stale replay is named only where it repeats a scored step's contribution (fingerprints are
taken at scored steps only); any other stale one is scored as what it is, an old update.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from ..robust.scoring import PROBE_SCALE
from .outer_scoring import OuterScoring


class _WholeModel:
    """What OuterScoring reads of its engine, for one contribution of the whole model a step: the
    comm, one fragment (every parameter), and the trainer step a scored round is taken at."""

    def __init__(self, comm, params):
        self.comm, self.fragments, self.pending = comm, [(0, params)], {}


class _StepLr:
    """The strategy's options as OuterScoring reads them, with no outer lr: the probe reads the
    step's own lr of each tensor (`StepScoring.lrs`)."""
    outer_lr = None

    def __init__(self, options):
        self.options = options

    def __getattr__(self, name):
        return getattr(self.options, name)


class StepScoring(OuterScoring):
    """Scores the strategy's contributions every `options.score_every` steps (`admitted`).
    `lrs()`: each parameter's lr at the step in progress."""
    KEY = "fragment0"

    def __init__(self, strategy, lrs: Callable[[], list[float]]):
        super().__init__(_WholeModel(strategy.comm, strategy.params), strategy.model, _StepLr(strategy.options),
                         strategy.inside)
        self.every, self.lrs = strategy.options.score_every, lrs

    def due(self, step: int) -> bool:
        """Is optimizer step `step` (0-based) a scored one?"""
        return step % self.every == 0

    def admitted(self, flat: torch.Tensor | None, step: int, world: int) -> torch.Tensor:
        """Which of the `world` senders the aggregate of optimizer step `step` takes (bool [W]):
        scored now (`flat`: each sender's payload decoded alone, rows [W, n]), or (None) as the
        last scored round decided."""
        if flat is not None:
            self.sync.pending[0] = step + 1  # the trainer step whose record gets the round
            keep = self.admit(self.KEY, flat)
        else:
            out = set(self.board.history[-1]["left_out"]) if self.board.history else set()
            keep = torch.tensor([self.board.slots[r] not in out for r in range(world)])
        if self.due(step + 1):
            self.held.take()  # a new period: the next scored step holds its own sequences
        return keep

    def _losses(self, i: int, rows: torch.Tensor, bases: list[int], mine: list[int], batches: torch.Tensor):
        """This validator's losses (robust/probe.py): `bases` at θ, each contribution in `mine`
        probed at θ − 0.2·lr·sign(Q_r) tensor by tensor (the module docstring); θ back bit for bit after."""
        params = self.sync.fragments[0][1]
        sizes, lrs, theta = [p.numel() for p in params], self.lrs(), []

        @contextmanager
        def kept():
            theta.extend(p.detach().clone() for p in params)
            try:
                yield
            finally:
                for p, t in zip(params, theta):
                    p.copy_(t)

        def move(r: int) -> None:
            for p, t, q, lr in zip(params, theta, rows[r].split(sizes), lrs):
                p.copy_(t - PROBE_SCALE * lr * q.view_as(p).sign().to(p.dtype))
        return self.probe(batches, bases, mine, rows.shape[0], move, kept)

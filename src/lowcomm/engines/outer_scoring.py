"""--score on the outer-sync engine: every contribution scored before it is aggregated
(robust/scoring.py has the rule, Covenant's; this module runs it on the engine's θ_global).

At each sync the wire gathers every worker's Δ_r (outer_wire.py) and asks `admit(key, rows)`
which rows to aggregate. The workers share the sequences each held this period (one
bookkeeping all-gather of token ids), and the scoring is spread over them: worker q scores
the contribution of worker (q + 1) mod W -- never its own -- on θ_global, and one all-reduce of
W × 3 values gives every worker every score, so all decide alike. A worker's cost per round:
four forwards of --score-batches sequences (the loss at θ_global and at θ_global − 0.2·lr·Δ_r, on
the contributor's batch and on the next worker's), whatever W. An emulated attacker scores
honestly (it attacks only its own contribution).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..contract.context import write_flat
from ..robust.scoring import PROBE_SCALE, HeldBatch, Scoreboard, next_token_loss


class OuterScoring:
    """Scores and admits the contributions to `sync`'s fragments (an OuterSync over `model`): a
    fragment's Δ_r moves only that fragment, the others held at their θ_global."""

    def __init__(self, sync, model: nn.Module, lr: float, sequences: int, patience: int):
        self.sync, self.model, self.lr = sync, model, lr
        self.held = HeldBatch(model, sequences)
        self.board = Scoreboard(sync.comm.world, patience, loud=sync.comm.rank == 0)

    def admit(self, key: str, rows: torch.Tensor, probe: torch.Tensor | None = None) -> torch.Tensor:
        """Every worker's Δ_r of the sync (rows [W, n], rank order) -> which the aggregate takes;
        each scored as `probe` has it (default: as sent; a compressed wire's median-norm clip:
        as clipped, as Covenant's validator scores it), replays named by `rows`."""
        probe = rows if probe is None else probe
        comm, world = self.sync.comm, rows.shape[0]
        batches = self._share(comm, self.held.take(), rows.device)
        table = torch.zeros(world, 3, dtype=torch.float64, device=rows.device)  # score, own gain, random gain
        target = (comm.rank + 1) % world
        i = next(i for i, (f, _) in enumerate(self.sync.fragments) if key == f"fragment{f}")
        table[target] = torch.tensor(self._score(i, probe[target], batches[target], batches[(target + 1) % world]),
                                     dtype=torch.float64)
        comm.meta_all_reduce(table, op="sum")
        if batches.numel() == 0:  # nobody held a sequence: no evidence this round
            return self.board.judge(rows, None, None)
        table = table.cpu()
        scores = [float(s) for s in table[:, 0]]
        fits = [1.0 if own > rand else -1.0 for own, rand in table[:, 1:].tolist()]
        return self.board.judge(rows, scores, fits)

    @staticmethod
    def _share(comm, mine: torch.Tensor | None, device) -> torch.Tensor:
        """Every worker's held sequences [W, n, T], cut to the fewest and shortest any holds (none
        held anywhere: [W, 0, 0], and every score of the round is 0)."""
        held = mine if mine is not None else torch.zeros(0, 0, dtype=torch.long, device=device)
        shapes = comm.meta_all_gather(torch.tensor(held.shape, dtype=torch.long, device=device))
        n, t = (int(v) for v in shapes.min(dim=0).values)
        return comm.meta_all_gather(held[:n, :t].contiguous())

    @torch.no_grad()
    def _score(self, i: int, delta: torch.Tensor, own: torch.Tensor, rand: torch.Tensor) -> list[float]:
        """(Gauntlet's score, own data's relative improvement, random data's) of one contribution
        to fragment i."""
        if own.numel() == 0 or own.shape[1] < 2:
            return [0.0, 0.0, 0.0]
        params = self.sync.fragments[i][1]
        g = self.sync.globals[i].detach()
        self.held.paused = True
        try:
            with self.sync.globals_in_model():
                before = [next_token_loss(self.model, b) for b in (own, rand)]
                write_flat(g - PROBE_SCALE * self.lr * delta.to(g.dtype), params)
                after = [next_token_loss(self.model, b) for b in (own, rand)]
        finally:
            self.held.paused = False
        gain = [(b - a) / b if b > 0 else 0.0 for b, a in zip(before, after)]
        return [gain[1], gain[0], gain[1]]

    def report(self) -> dict:
        return self.board.report()

"""--attack and --aggregate for a strategy that all-gathers every worker's payload itself each
step (DeMo's DCT top-k): a mixin on the strategy, named before Strategy in its bases.

    val = self.attacked_values(f"stack{j}", val)   # an attack on values, before packing
    mine = self.attacked_payload(mine)              # a replay (copy, stale), after packing
    qs = self.combined(self.dct.decode, rows, step) # the mean decode, or each sender decoded alone
                                                    # and aggregated (robust aggregators), of the
                                                    # senders --score admits

It reads the strategy's `options` (GatheredRobustOptions) and `comm`; with --aggregate mean, no
attacker and no --score it changes nothing (the same calls, the same bits). With --score the
strategy sets `scoring` (engines/step_scoring.py: robust/ imports no engine), the mixin keeps its
state and reports its rounds, and the run's outputs read its rounds from it (train/outputs.py:
`rounds_from`, `standing_changes`, as from the outer-sync engine's OuterScoring).

Under --elastic (`GatheredRules`: every step a commit point, as for any strategy) a worker is named
by its slot, as the outer-sync engine names it: the attackers are the launcher's worker numbers,
the scoreboard is replicated state (a joiner takes it from a peer; one left out stays out as
members come and go), and the held sequences and the attacker's rounds are each worker's own.
"""
from __future__ import annotations

import torch

from ..contract.elastic import ElasticRules
from .aggregators import aggregated, decoded_senders
from .emulation import attackers_of, name_by_slot, untrusted_parts
from .scoring import first_of_equal_rows

_UNSET = object()


class GatheredRules(ElasticRules):
    """--elastic's rules (contract/elastic.py) for a strategy on this mixin: its attackers and
    scoreboard name each rank by its slot in the membership."""

    @classmethod
    def name_members(cls, strategy, slots) -> None:
        name_by_slot(slots, strategy.attackers, strategy.scoring)


class GatheredUpdate:
    elastic = GatheredRules
    _attackers = _UNSET
    scoring = None  # --score: the strategy's StepScoring (engines/step_scoring.py)

    @property
    def attackers(self):
        if self._attackers is _UNSET:  # built at first use: the mixin adds nothing to __init__
            self._attackers = attackers_of(self.options)
        return self._attackers

    def attacked_values(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """What this rank packs in place of `values` (every rank calls it, in the same order)."""
        return values if self.attackers is None else self.attackers.values(self.comm, key, values)

    def attacked_payload(self, payload: torch.Tensor) -> torch.Tensor:
        """What this rank sends in place of its packed `payload` (every rank calls it)."""
        return payload if self.attackers is None else self.attackers.payload(self.comm, "payload", payload)

    def untrusted_report(self) -> dict:
        """summary.json's record of the aggregate and the emulated attack."""
        return {"aggregate": self.options.aggregator().spec, **(self.attackers.report() if self.attackers else {}),
                **(self.scoring.report() if self.scoring is not None else {})}

    def state_parts(self):
        """The strategy's parts, --score's scoreboard and held sequences, and --attack's rounds
        and replays (a resumed run attacks as the uninterrupted one)."""
        return {**super().state_parts(), **untrusted_parts(self.attackers, self.scoring)}

    def release(self) -> None:
        super().release()
        if self.scoring is not None:  # --score's held-sequence hook off the model
            self.scoring.held.close()

    def combined(self, decode, rows: torch.Tensor, step: int = 0) -> list[torch.Tensor]:
        """Every worker's payload (rows [W, b]) at optimizer step `step` -> the per-tensor update:
        `decode` of them all (the strategy's mean), or with a robust --aggregate each decoded alone
        and aggregated; with --score of the senders admitted (the mean decode of their rows alone is
        the mean over the admitted senders of each coefficient, exactly)."""
        aggregator, scoring = self.options.aggregator(), self.scoring
        if scoring is None:
            return aggregated(aggregator, *decoded_senders(decode, rows)) if aggregator.robust else decode(rows)
        scored = scoring.due(step)
        flat, like = decoded_senders(decode, rows) if scored or aggregator.robust else (None, None)
        keep = scoring.admitted(flat if scored else None, step, rows.shape[0])
        if not scored:  # a copy between scored rounds: its content once (the copier is not known)
            keep &= first_of_equal_rows(rows)
        keep = keep.to(rows.device)
        if aggregator.robust:
            return aggregated(aggregator, flat if keep.all() else flat[keep], like)
        return decode(rows if keep.all() else rows[keep])

"""--attack and --aggregate for a strategy that all-gathers every worker's payload itself each
step (DeMo's DCT top-k): a mixin on the strategy, named before Strategy in its bases.

    val = self.attacked_values(f"stack{j}", val)   # an attack on values, before packing
    mine = self.attacked_payload(mine)              # a replay (copy, stale), after packing
    qs = self.combined(self.dct.decode, rows)       # the mean decode, or each sender decoded alone
                                                    # and aggregated (robust aggregators)

It reads the strategy's `options` (RobustOptions) and `comm`; with --aggregate mean and no
attacker it changes nothing (the same calls, the same bits).
"""
from __future__ import annotations

import torch

from .aggregators import aggregate_senders
from .emulation import attackers_of

_UNSET = object()


class GatheredUpdate:
    _attackers = _UNSET

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
        return {"aggregate": self.options.aggregator().spec, **(self.attackers.report() if self.attackers else {})}

    def combined(self, decode, rows: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's payload (rows [W, b]) -> the per-tensor update: `decode` of them all
        (the strategy's mean), or with a robust --aggregate each decoded alone and aggregated."""
        aggregator = self.options.aggregator()
        return aggregate_senders(decode, rows, aggregator) if aggregator.robust else decode(rows)

"""Untrusted workers: emulated attacks on the outer gradient (attacks.py, emulation.py), robust
aggregators of the workers' contributions (aggregators.py), contribution scoring (scoring.py)
and their flags (options.py). The outer-sync engine (engines/outer_sync.py, outer_wire.py,
outer_scoring.py) applies them, and gathered.py for a strategy that gathers payloads itself
(DeMo); nothing here knows a strategy.

Imports: contract, comm, models, errors.
"""
from .aggregators import Aggregator, parse_aggregator
from .attacks import Attack, Round, check_own_loop, parse_attack, parse_ranks
from .emulation import Attackers, attackers_of, data_attack, name_by_slot, refuse_own_loss, untrusted_parts
from .gathered import GatheredUpdate
from .options import GatheredRobustOptions, RobustOptions

__all__ = ["Aggregator", "Attack", "Attackers", "GatheredRobustOptions", "GatheredUpdate", "Round", "RobustOptions",
           "attackers_of", "check_own_loop", "data_attack", "name_by_slot", "refuse_own_loss", "parse_aggregator",
           "parse_attack", "parse_ranks", "untrusted_parts"]

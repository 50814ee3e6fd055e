"""Untrusted workers: emulated attacks on the outer gradient (attacks.py, emulation.py), robust
aggregators of the workers' contributions (aggregators.py) and their flags (options.py). The
outer-sync engine (engines/outer_sync.py, outer_wire.py) applies them; nothing here knows a
strategy.

Imports: contract, comm, models, errors.
"""
from .aggregators import Aggregator, parse_aggregator
from .attacks import Attack, Round, parse_attack, parse_ranks
from .emulation import Attackers
from .options import RobustOptions

__all__ = ["Aggregator", "Attack", "Attackers", "Round", "RobustOptions", "parse_aggregator", "parse_attack",
           "parse_ranks"]

"""The papers: each file registers one strategy by name (registry.py); they are discovered, not
listed. hsdp.py is ddp's form with FSDP inside. The contract they implement is in contract/,
what they are built from in engines/; the names below are re-exported for strategy authors.

Imports: contract, engines, comm, compress, robust, errors.
"""
from ..contract.base import Strategy
from ..contract.context import StepContext, StepResult
from ..contract.options import Options, option
from ..contract.plan import PlannedOp
from .registry import available, get, option_table, register

__all__ = ["Options", "PlannedOp", "StepContext", "StepResult", "Strategy", "available", "get", "option",
           "option_table", "register"]

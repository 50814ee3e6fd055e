"""Strategies: each file registers one by name (see registry.py); they are discovered, not listed."""
from .base import StepResult, Strategy
from .options import Options, option
from .plan import PlannedOp
from .registry import available, get, make_strategy, option_table, register

__all__ = ["Options", "PlannedOp", "StepResult", "Strategy", "available", "get", "make_strategy",
           "option", "option_table", "register"]

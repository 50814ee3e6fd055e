"""Strategies: each file registers one by name (see registry.py); they are discovered, not listed."""
from .base import Strategy
from .context import StepContext, StepResult
from .options import Options, option
from .plan import PlannedOp
from .registry import available, get, option_table, register

__all__ = ["Options", "PlannedOp", "StepContext", "StepResult", "Strategy", "available", "get", "option",
           "option_table", "register"]

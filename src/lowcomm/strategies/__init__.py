"""Strategies register themselves by name on import."""
from . import acco, ddp, dpu, zero1  # noqa: F401  (registration)
from .base import StepResult, Strategy, available, make_strategy, register

__all__ = ["StepResult", "Strategy", "available", "make_strategy", "register"]

"""Turning what a user wrote (a CLI string, a TOML value, a Python keyword) into a typed value.

One converter per kind of value, so the CLI, the TOML file and the Python API
reject the same bad value with the same one-line message. Composite values
(`--slowdown 1,2`, `--stragglers 0.1,3`) are parsed here once; nothing
downstream sees their strings.
"""
from __future__ import annotations

import math
from typing import Any

from .errors import UsageError


def convert(raw: Any, typ: str, name: str) -> Any:
    """raw -> a value of `typ` ('bool', 'int', 'float' or 'str'); UsageError naming `name` otherwise."""
    if typ == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{name} must be true or false, got {str(raw)!r}")
    if typ == "int":
        if isinstance(raw, bool):
            raise UsageError(f"{name} must be an integer, got {raw!r}")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        try:
            return int(str(raw).strip())
        except ValueError:
            raise UsageError(f"{name} must be an integer, got {str(raw)!r}") from None
    if typ == "float":
        if isinstance(raw, bool):
            raise UsageError(f"{name} must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a number, got {str(raw)!r}") from None
        if not math.isfinite(value):
            raise UsageError(f"{name} must be a finite number, got {str(raw)!r}")
        return value
    if typ == "str":
        if not isinstance(raw, str):
            raise UsageError(f"{name} must be a string, got {raw!r}")
        return raw
    raise AssertionError(f"no converter for type {typ!r}")


def _numbers(raw: Any) -> list[str]:
    """'1, 2.5' or [1, 2.5] -> ['1', '2.5']."""
    if isinstance(raw, (list, tuple)):
        return [str(x).strip() for x in raw]
    text = str(raw).strip()
    return [p.strip() for p in text.split(",")] if text else []


def parse_slowdown(raw: Any, name: str = "slowdown") -> tuple[float, ...]:
    """'f1,...,fW' -> per-rank slowdown factors, each >= 1 (empty: none set)."""
    text = ",".join(_numbers(raw))
    factors = []
    for part in _numbers(raw):
        try:
            f = float(part)
        except ValueError:
            raise UsageError(f"{name} factor '{part}' in '{text}' is not a number") from None
        if not (math.isfinite(f) and f >= 1):
            raise UsageError(f"{name} factor '{part}' in '{text}' must be at least 1 "
                             f"(1 = full speed, 2 = twice as slow)")
        factors.append(f)
    return tuple(factors)


def parse_stragglers(raw: Any, name: str = "stragglers") -> tuple[float, float] | None:
    """'P,F' -> (P, F): each step, with probability P one random rank is F times slower."""
    parts = _numbers(raw)
    if not parts:
        return None
    text = ",".join(parts)
    try:
        p, f = (float(x) for x in parts)
    except ValueError:
        raise UsageError(f"{name} '{text}' must be P,F (e.g. 0.1,3)") from None
    if not 0 <= p <= 1:
        raise UsageError(f"{name} probability '{parts[0]}' in '{text}' must be in [0, 1]")
    if not (math.isfinite(f) and f >= 1):
        raise UsageError(f"{name} factor '{parts[1]}' in '{text}' must be at least 1")
    return p, f


def format_numbers(values) -> str:
    """(1.0, 2.5) -> '1,2.5' (how the resolved config writes a parsed list back)."""
    return ",".join(f"{v:g}" for v in values) if values else ""

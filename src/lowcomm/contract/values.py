"""Turning what a user wrote (a CLI string, a TOML value, a Python keyword) into a typed value.

One converter per kind of value, so the CLI, the TOML file and the Python API
reject the same bad value with the same one-line message. Composite values
(`--slowdown 1,2`, `--stragglers 0.1,3`) are parsed here once; nothing
downstream sees their strings.
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import UsageError

INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


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
            value = raw
        elif isinstance(raw, float) and raw.is_integer():
            value = int(raw)
        else:
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise UsageError(f"{name} must be an integer, got {str(raw)!r}") from None
        # Counts, sizes and seeds end up in int64 tensors and torch's seeding: refuse what they cannot hold.
        if not INT64_MIN <= value <= INT64_MAX:
            raise UsageError(f"{name} {value} is beyond what a 64-bit integer holds (at most {INT64_MAX})")
        return value
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


_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(raw: Any, name: str, integer: bool = True) -> float:
    """'2M' -> 2_000_000, '1.3e9' or '1.3B' -> 1.3e9 (k, M, B/G, T; decimal): a positive count."""
    text = str(raw).strip()
    head, suffix = (text[:-1], text[-1].lower()) if text and text[-1].isalpha() else (text, "")
    try:
        value = float(head) * _SUFFIXES[suffix]
    except (KeyError, ValueError):
        raise UsageError(f"{name} '{text}' is not a count (e.g. 4M, 1.3e9, 350M)") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{name} '{text}' must be positive")
    if integer and value < 1:
        raise UsageError(f"{name} '{text}' must be at least 1")
    return round(value) if integer else value

"""The registry: strategies by name, discovered from the files under strategies/.

A strategy is one file: `@register("name")` on a Strategy subclass whose
`Options` dataclass declares its knobs. Every module in this package is
imported on first use, so adding or deleting a strategy's file needs no other
edit; the CLI flags, TOML tables and `--help` lines come from `option_table()`.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, fields

from ..errors import UsageError
from ..contract.base import Strategy
from ..contract.options import cli_flag, type_name

_REGISTRY: dict[str, type[Strategy]] = {}
_discovered = False


def register(name: str):
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return deco


def unregister(name: str) -> None:
    """Remove a strategy (tests that register a toy one clean up with this)."""
    _REGISTRY.pop(name, None)


def _discover() -> None:
    """Import every public module of this package once: each strategy file registers itself."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):  # private helpers, imported by the strategies that use them
            continue
        importlib.import_module(f"{__package__}.{info.name}")


def available() -> list[str]:
    _discover()
    return sorted(_REGISTRY)


def get(name: str) -> type[Strategy]:
    _discover()
    if name not in _REGISTRY:
        raise UsageError(f"unknown strategy '{name}' (choose from: {', '.join(available())})")
    return _REGISTRY[name]


def resolve(name: str, options):
    """(name, options) of the strategy that runs when `name` is chosen with `options`. A strategy
    class may define `resolve(options) -> (name, options, note)` to hand an older spelling to the
    strategy that now has a name of its own (`quantized --bits 1` is onebit_adam); the note then
    goes to stderr, one line."""
    hook = getattr(get(name), "resolve", None)
    if hook is None:
        return name, options
    target, resolved, note = hook(options)
    if target != name:
        get(target)
        print(f"note: {note}", file=sys.stderr, flush=True)
    return target, resolved


def reproducible_flags(name: str) -> list[str]:
    """The CLI flags that set strategy `name`'s `reproducible_options` (a run that then depends
    only on its inputs, not on timing: what bit-exact comparisons run with)."""
    cls = get(name)
    by_name = {f.name: f for f in fields(cls.Options)}
    out: list[str] = []
    for key, value in cls.reproducible_options.items():
        flag = cli_flag(by_name[key])
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


@dataclass
class OptionFlag:
    """One CLI flag of the strategy options: which strategies have it and how it reads."""
    flag: str
    field: str
    type: str
    help: str
    default: object
    strategies: list[str]
    defaults: dict  # strategy -> its default (a preset such as sparseloco changes some)


def option_table() -> dict[str, OptionFlag]:
    """flag -> OptionFlag over every registered strategy. Strategies may share a
    flag (e.g. --sync-every) as long as it means the same type."""
    table: dict[str, OptionFlag] = {}
    for name in available():
        for f in fields(_REGISTRY[name].Options):
            flag = cli_flag(f)
            entry = table.get(flag)
            if entry is None:
                table[flag] = OptionFlag(flag, f.name, type_name(f), f.metadata.get("help", ""),
                                         f.default, [name], {name: f.default})
            elif entry.field != f.name or entry.type != type_name(f):
                raise RuntimeError(f"strategies {entry.strategies} and '{name}' declare {flag} differently")
            else:
                entry.strategies.append(name)
                entry.defaults[name] = f.default
    return table

"""The config as a file: loading a TOML file into a RunConfig, and writing one back
(to_toml / to_dict) that loads to the same values."""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from ..errors import UsageError
from ..strategies import registry
from .schema import RunConfig
from .setting import _is_strategy_table, set_value


def load_toml(path: str | Path, cfg: RunConfig | None = None) -> RunConfig:
    cfg = cfg or RunConfig()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"config file '{path}' cannot be read: {e.__class__.__name__}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file '{path}' is not valid TOML: {e}") from None

    def walk(table: dict, prefix: str) -> None:
        for k, v in table.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                if not prefix and _is_strategy_table(k):
                    walk(v, key + ".")
                    continue
                target: Any = cfg
                for part in key.split("."):
                    if not dataclasses.is_dataclass(target) or part not in {f.name for f in fields(target)}:
                        raise UsageError(f"unknown config key '{key}' in {path}")
                    target = getattr(target, part)
                if not dataclasses.is_dataclass(target):
                    raise UsageError(f"config key '{key}' in {path} must be a value, not a table")
                walk(v, key + ".")
            else:
                try:
                    set_value(cfg, key, v)
                except UsageError as e:
                    raise UsageError(f"{e} (in {path})") from None

    walk(data, "")
    return cfg


def _shown(obj) -> dict:
    """A config dataclass as TOML-ready values (typed values written back as text)."""
    out = {}
    for f in fields(obj):
        if f.metadata.get("internal"):
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = _shown(v)
        elif "show" in f.metadata:
            out[f.name] = f.metadata["show"](v) if v not in (None, ()) else ""
        else:
            out[f.name] = v
    return out


def to_dict(cfg: RunConfig) -> dict:
    """The resolved config as the nested dict its config.toml reads back to:
    run settings, tables, and the chosen strategy's options as `[<strategy>]`."""
    d = _shown(cfg)
    options = cfg.strategy_options() if cfg.strategy in registry.available() else None
    if options is not None and fields(options):
        d[cfg.strategy] = options.as_dict()
    return d


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that `--config` reads back unchanged."""
    top, tables = [], []
    for key, v in to_dict(cfg).items():
        if isinstance(v, dict):
            tables.append("\n".join([f"[{key}]"] + [f"{k} = {_toml_value(x)}" for k, x in v.items()]))
        else:
            top.append(f"{key} = {_toml_value(v)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"


def from_dict(d: dict) -> RunConfig:
    cfg = RunConfig()
    for k, v in d.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                set_value(cfg, f"{k}.{k2}", v2)
        else:
            set_value(cfg, k, v)
    return cfg

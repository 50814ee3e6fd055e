"""Setting config values: a dotted key from a CLI string or a TOML value, typed and checked
where it is set, and strategy options routed to the strategy that declares them."""
from __future__ import annotations

import dataclasses
from dataclasses import fields
from functools import partial
from typing import Any

from ..comm.link import split_link_spec
from ..errors import UsageError
from ..strategies import registry
from ..contract.options import Options, cli_flag, type_name
from ..contract.values import convert
from .schema import RunConfig


LINK_TABLES = ("link", "intra_link")  # tables that a one-line BANDWIDTH,LATENCY[,JITTER] may also set


def _section_and_field(cfg: RunConfig, key: str):
    """'optim.lr' -> (cfg.optim, Field lr). Raises UsageError for unknown keys."""
    obj: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        by_name = {f.name: f for f in fields(obj) if not f.metadata.get("internal")}
        if part not in by_name:
            raise UsageError(f"unknown config key '{key}'")
        f = by_name[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise UsageError(f"config key '{key}' is a table, not a value")
            return obj, f
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(obj):
            raise UsageError(f"unknown config key '{key}'")
    raise UsageError(f"unknown config key '{key}'")


def _is_strategy_table(name: str) -> bool:
    return name in registry.available()


def _option_field(options: Options, key: str, strategy: str):
    by_name = {f.name: f for f in fields(options)}
    if key not in by_name:
        known = ", ".join(by_name) or "none"
        raise UsageError(f"unknown config key '{strategy}.{key}' (options of {strategy}: {known})")
    return by_name[key]


def set_value(cfg: RunConfig, key: str, raw: Any, name: str | None = None) -> None:
    """Set dotted `key` from a raw value (CLI string or TOML value).
    `name` is how the user wrote it (e.g. '--lr'), for the error message and, kept in
    cfg.written_as, for any refusal made later (spelled); a TOML value is named by its key.
    '<strategy>.<option>' sets a strategy option; a bare strategy option name
    ('max_accum', or 'param_dtype' as older configs wrote it) waits in
    pending_options until the strategy is known."""
    head, _, rest = key.partition(".")
    if rest and _is_strategy_table(head):
        options = cfg.strategy_options(head)
        f = _option_field(options, rest, head)
        setattr(options, f.name, _convert(raw, type_name(f), name or key))
        cfg.written_as[key] = name or key
        return
    if not rest and key not in {f.name for f in fields(cfg)} and key in _all_option_fields():
        set_option(cfg, key, raw, name or key)
        return
    if key in LINK_TABLES:  # link = "100mbit,20ms" in TOML, as --link spells it
        if not isinstance(raw, str):
            raise UsageError(f'{name or key} must be text, "BANDWIDTH,LATENCY[,JITTER]" (e.g. "100mbit,20ms"), or '
                             f"a [{key}] table, got {_as_toml(raw)}")
        return set_link(cfg, raw, name or key, key)
    obj, f = _section_and_field(cfg, key)
    parse = f.metadata.get("parse")
    setattr(obj, f.name, parse(raw, name or key) if parse else _convert(raw, type_name(f), name or key))
    cfg.written_as[key] = name or key


def _convert(raw: Any, typ: str, name: str) -> Any:
    """convert(), held to TOML's types where booleans are concerned: an on/off setting takes only
    true or false (`eager = "yes"` or `eager = 1` is refused, not read as on), and a number or a
    string takes no boolean. The CLI's on/off flags hand over booleans, its other values text."""
    if (typ == "bool") != isinstance(raw, bool):
        wanted = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}.get(typ, typ)
        raise UsageError(f"{name} must be {wanted}, got {_as_toml(raw)}")
    return convert(raw, typ, name)


def _as_toml(raw: Any) -> str:
    """A value as a TOML file writes it: true, 1, "yes"."""
    if isinstance(raw, bool):
        return "true" if raw else "false"
    return f'"{raw}"' if isinstance(raw, str) else repr(raw)


def spelled(cfg: RunConfig, key: str, value: Any = None) -> str:
    """Setting `key` as its user wrote it, for a refusal to name: the flag typed ('--max-restarts'),
    else the TOML key, else (not given) the flag that sets it; with `value`, '--replicas -1' or
    'replicas = -1'."""
    name = cfg.written_as.get(key) or _flag_of(key)
    if value is None:
        return name
    return f"{name} {value}" if name.startswith("--") else f"{name} = {value}"


def _flag_of(key: str) -> str:
    """The flag that sets config key `key` (a run flag or a strategy option's), else the key."""
    from .flags import LINK_FLAGS, RUN_FLAGS
    flag = next((name for name, f in RUN_FLAGS.items() if f.key == key), None)
    flag = flag or next((name for name, table in LINK_FLAGS.items() if table == key), None)
    head, _, rest = key.partition(".")
    if flag is None and rest and _is_strategy_table(head):
        flag = next((cli_flag(f) for f in fields(registry.get(head).Options) if f.name == rest), None)
    return flag or key


def set_option(cfg: RunConfig, field_name: str, raw: Any, name: str) -> None:
    """A strategy option given without its table (a CLI flag): applied to the chosen
    strategy by validate(), once the strategy is known."""
    cfg.pending_options[field_name] = (raw, name)


def _all_option_fields() -> dict[str, list[str]]:
    """option field name -> the strategies that declare it."""
    owners: dict[str, list[str]] = {}
    for name in registry.available():
        for f in fields(registry.get(name).Options):
            owners.setdefault(f.name, []).append(name)
    return owners


def resolve_options(cfg: RunConfig) -> Options:
    """Apply pending options to the chosen strategy and check all of its options."""
    options = cfg.strategy_options()
    given = {key: raw for key, (raw, _) in cfg.pending_options.items()}  # the flags the command line gave
    for key, (raw, name) in cfg.pending_options.items():
        by_name = {f.name: f for f in fields(options)}
        if key not in by_name:
            owners = ", ".join(_all_option_fields().get(key, [])) or "none"
            raise UsageError(f"{name} does not apply to strategy '{cfg.strategy}' (it is an option of: {owners})")
        setattr(options, key, _convert(raw, type_name(by_name[key]), name))
        cfg.written_as[f"{cfg.strategy}.{key}"] = name
    cfg.pending_options.clear()
    for strategy, opts in cfg.options.items():
        opts.validate(strategy)
    other = next((name for name in cfg.options if name != cfg.strategy), None)
    if other is not None:  # as a flag of another strategy is refused, so is its table
        raise UsageError(f"[{other}] ({', '.join(f'{other}.{k}' for k in cfg.options[other].as_dict()) or 'a table'}) "
                         f"does not apply to strategy '{cfg.strategy}' (drop the table, or set strategy = \"{other}\")")
    options.check_given(given)
    options.check_run(cfg)
    return options


def set_link(cfg: RunConfig, raw: str, name: str = "--link", table: str = "link") -> None:
    """--link BANDWIDTH,LATENCY[,JITTER] -> the [link] table's three typed values (--intra-link: [intra_link])."""
    bandwidth, latency, jitter = split_link_spec(raw, name)
    cfg.written_as[table] = name
    for key, value in (("bandwidth", bandwidth), ("latency", latency), ("jitter", jitter)):
        set_value(cfg, f"{table}.{key}", value, f"{name} {key}")


def make_link(cfg: RunConfig, seed: int = 0, table: str = "link"):
    """The configured comm.link.LinkModel ([link], or [intra_link]), or None for no emulation."""
    from ..comm.link import LinkModel
    ln = getattr(cfg, table)
    if ln.bandwidth is None:
        return None
    return LinkModel(ln.bandwidth, ln.latency, ln.jitter, seed=seed)



def link_factories(cfg: RunConfig) -> tuple:
    """make_link for [link] and for [intra_link], each a function of the seed (run/build.py's LinkOf)."""
    return partial(make_link, cfg), partial(make_link, cfg, table="intra_link")
"""A strategy's options, declared once beside its class.

    @dataclass
    class AccoOptions(ShardedOptions):
        deterministic: bool = option(False, "exactly --accum micro-batches per round")
        max_accum: int = option(0, "most micro-batches per round while communicating (0: 4*accum)", min=0)

From that declaration alone the registry derives the CLI flag (`--max-accum`,
or `flag=` to keep an older spelling), its `--help` line, the TOML table
(`[acco] max_accum = 8`), the Python keyword (`make_strategy("acco", ...,
max_accum=8)`), the resolved `config.toml` and validation with a one-line
error. The defaults are the dataclass defaults, so every entry point agrees.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import UsageError
from .values import convert


def option(default: Any, help: str, *, flag: str | None = None, min: float | None = None,
           max: float | None = None, above: float | None = None, choices: tuple | None = None):
    """A strategy option: its default, its one-line help and its bounds.
    `min`/`max` are inclusive, `above` exclusive; `flag` overrides the CLI spelling."""
    return field(default=default, metadata={"help": help, "flag": flag, "min": min, "max": max,
                                            "above": above, "choices": choices})


@dataclass(frozen=True)
class RunShape:
    """What `Options.check_run` may read of a run: a config.RunConfig has these fields too, and
    wrap() (which has no RunConfig: the library never imports config) passes this."""
    strategy: str
    workers: int
    replicas: int
    accum: int
    inside: str = "ddp"


@dataclass
class Options:
    """Base of every strategy's options (a strategy without options uses it as is)."""

    def check(self) -> None:
        """Rules that involve more than one field; subclasses raise UsageError."""

    def check_model(self, layout) -> None:
        """Rules that involve the model (models.layout.ModelLayout: shapes, blocks), checked at
        launch before anything is written: a value the model cannot honour is refused, never
        clamped silently. Subclasses raise UsageError."""

    def check_run(self, cfg) -> None:
        """Rules that involve the run's settings too (cfg: a RunShape or config.RunConfig, e.g. its accum);
        called once the strategy is chosen. Subclasses raise UsageError."""

    def check_length(self, steps: int) -> None:
        """Rules that involve the run's length (--steps), checked for a run that will train (train,
        bench), not for a plan's steady state. Subclasses raise UsageError."""

    def check_given(self, given: dict[str, str]) -> None:
        """Rules on which options the command line gave (field -> the text given), where a value
        alone cannot tell a flag that would do nothing from a default (e.g. a flag that needs
        another one). Subclasses raise UsageError."""

    def run_note(self, cfg) -> str | None:
        """One line said before a CLI run starts where these settings are legal but easily
        misread (cfg: a config.RunConfig); None: nothing to say."""
        return None

    def validate(self, strategy: str = "", where: str = "") -> "Options":
        """Convert each value to its declared type and check its bounds; UsageError
        names the first bad value by its flag and TOML key (`where` adds e.g. ' (in run.toml)')."""
        for f in fields(self):
            name = f"{cli_flag(f)} ({strategy}.{f.name})" if strategy else cli_flag(f)
            value = convert(getattr(self, f.name), type_name(f), name)
            setattr(self, f.name, value)
            meta = f.metadata
            if meta.get("choices") and value not in meta["choices"]:
                raise UsageError(f"{name} '{value}' is not one of: {', '.join(map(str, meta['choices']))}{where}")
            if meta.get("min") is not None and value < meta["min"]:
                raise UsageError(f"{name} must be at least {meta['min']}, got {value}{where}")
            if meta.get("max") is not None and value > meta["max"]:
                raise UsageError(f"{name} must be at most {meta['max']}, got {value}{where}")
            if meta.get("above") is not None and value <= meta["above"]:
                raise UsageError(f"{name} must be greater than {meta['above']}, got {value}{where}")
        self.check()
        return self

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def type_name(f: dataclasses.Field) -> str:
    """'int', 'float', 'bool' or 'str', whether or not the module postpones annotations."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def cli_flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def with_defaults(base: type[Options], name: str, module: str, **defaults) -> type[Options]:
    """A subclass of `base` in which the named options have other defaults (a preset, e.g.
    sparseloco = diloco with the paper's settings); flags, help and bounds stay base's.
    Bind it to `name` in `module` (the caller's __name__), so that it pickles."""
    by_name = {f.name: f for f in fields(base)}
    unknown = sorted(set(defaults) - set(by_name))
    if unknown:
        raise TypeError(f"{base.__name__} has no option {unknown[0]}")
    specs = [(k, by_name[k].type, field(default=v, metadata=by_name[k].metadata)) for k, v in defaults.items()]
    cls = dataclasses.make_dataclass(name, specs, bases=(base,))
    cls.__module__ = module
    return cls


def build_options(cls: type[Options], values: dict, strategy: str, where: str = "") -> Options:
    """Options of `cls` from keyword values (wrap(), make_run()); unknown names are a UsageError
    listing the known ones, and an on/off option takes only a bool: `eager="yes"` or `eager=1` is
    refused, not read as on (validate() alone would parse text, as the CLI's flags need)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        listed = ", ".join(sorted(known)) or "none"
        raise UsageError(f"unknown option '{unknown[0]}' for strategy '{strategy}'{where} (its options: {listed})")
    for f in fields(cls):  # the Python keywords held to their types as TOML's are (config/setting.py)
        if f.name in values and type_name(f) == "bool" and not isinstance(values[f.name], bool):
            raise UsageError(f"{cli_flag(f)} ({strategy}.{f.name}) must be True or False, got "
                             f"{values[f.name]!r}{where}")
    return cls(**values).validate(strategy, where)

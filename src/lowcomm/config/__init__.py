"""Run configuration: dataclasses, TOML loading, CLI overrides and validation.

Every run-level value a user can set lives here with its type and its check,
so the CLI, the TOML file and the Python API all reject the same bad values
with the same one-line message. Strategy options are not listed here: each
strategy declares its own (strategies/options.py), and the registry supplies
their TOML tables (`[<strategy>]`), flags and checks. Composite values (`--link`,
`--slowdown`, `--stragglers`) are parsed into typed values when they are set.

One module a job: schema.py (the dataclasses, presets and fixed choices), setting.py
(setting a value by key, strategy options, links), tomlio.py (reading and writing TOML),
checks.py (validate). The names below are the package's interface.
"""
from ..errors import UsageError
from .checks import validate
from .schema import (BACKENDS, DEVICES, HF_PREFIX, MAX_TIMEOUT_S, MODEL_PRESETS, SCHEDULES, DataConfig,
                     LinkConfig, ModelConfig, OptimConfig, RunConfig)
from .setting import make_link, resolve_options, set_link, set_option, set_value
from .tomlio import from_dict, load_toml, to_dict, to_toml

__all__ = ["BACKENDS", "DEVICES", "HF_PREFIX", "MAX_TIMEOUT_S", "MODEL_PRESETS", "SCHEDULES", "DataConfig",
           "LinkConfig", "ModelConfig", "OptimConfig", "RunConfig", "UsageError", "from_dict", "load_toml",
           "make_link", "resolve_options", "set_link", "set_option", "set_value", "to_dict", "to_toml",
           "validate"]

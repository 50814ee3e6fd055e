"""Run configuration: dataclasses, TOML loading, CLI overrides and validation.

Every run-level value a user can set lives here with its type and its check,
so the CLI, the TOML file and the Python API all reject the same bad values
with the same one-line message. Strategy options are not listed here: each
strategy declares its own (contract/options.py), and the registry supplies
their TOML tables (`[<strategy>]`), flags and checks. Composite values (`--link`,
`--slowdown`, `--stragglers`) are parsed into typed values when they are set.

One module a job: schema.py (the dataclasses, presets and fixed choices), setting.py
(setting a value by key, strategy options, links), tomlio.py (reading and writing TOML),
checks.py (validate), flags.py (the run flags' table), nodes.py (one replica per node
under torchrun). The names below are the package's interface.
Imports: strategies, engines, contract, comm (what it configures), models (what --init-from holds), lazy
(its names imported on first use), errors.
"""
from __future__ import annotations

from ..lazy.exports import lazy_exports

# name -> the module that defines it, imported on first use (PEP 562): the run flags' table
# (flags.py) is read by `lowcomm --help`, which must not wait for torch (checks.py imports
# the strategy registry)
_EXPORTS = {
    "UsageError": "..errors", "validate": ".checks",
    **{n: ".schema" for n in ("BACKENDS", "DEVICES", "HF_PREFIX", "MAX_TIMEOUT_S", "MODEL_PRESETS", "PRECISIONS",
                              "SCHEDULES", "DataConfig", "LinkConfig", "ModelConfig", "OptimConfig", "RunConfig")},
    **{n: ".setting" for n in ("make_link", "link_factories", "resolve_options", "set_link", "set_option",
                               "set_value", "spelled")},
    **{n: ".tomlio" for n in ("from_dict", "load_toml", "to_dict", "to_toml")},
}

__all__ = ["BACKENDS", "DEVICES", "HF_PREFIX", "MAX_TIMEOUT_S", "MODEL_PRESETS", "PRECISIONS", "SCHEDULES",
           "DataConfig", "LinkConfig", "ModelConfig", "OptimConfig", "RunConfig", "UsageError", "from_dict",
           "load_toml", "link_factories", "make_link", "resolve_options", "set_link", "set_option", "set_value", "spelled",
           "to_dict", "to_toml", "validate"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

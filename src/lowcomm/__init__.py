"""lowcomm: communication-efficient data-parallel training on torch.distributed.

The public names below are imported on first use (PEP 562): `lowcomm --help` and
`lowcomm --version` import this package, and must not wait seconds for torch.
"""
from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# name -> (the submodule that defines it, its name there)
_EXPORTS = {
    "Comm": ("comm", "Comm"), "CommStats": ("comm", "CommStats"), "RunConfig": ("config", "RunConfig"),
    "RunError": ("errors", "RunError"), "UsageError": ("errors", "UsageError"),
    "GPT": ("models", "GPT"), "build_hf_causal_lm": ("models", "build_hf_causal_lm"), "lm_loss": ("models", "lm_loss"),
    "RunDriver": ("run", "RunDriver"), "make_run": ("run", "make_run"),
    "make_strategy": ("run", "make_run"),  # the name of lowcomm 0.1's builder
    "StepResult": ("strategies", "StepResult"), "Strategy": ("strategies", "Strategy"),
    "available": ("strategies", "available"), "wrap": ("wrap", "wrap"),
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        # Importing lowcomm.wrap bound the submodule to the name `wrap`: the function must win.
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # lowcomm.strategies, as before
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

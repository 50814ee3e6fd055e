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
    "RunDriver": ("run.driver", "RunDriver"), "make_run": ("run.driver", "make_run"),
    "make_strategy": ("run.driver", "make_run"),  # the name of lowcomm 0.1's builder
    "StepResult": ("strategies", "StepResult"), "Strategy": ("strategies", "Strategy"),
    "available": ("strategies", "available"), "wrap": ("run.wrap", "wrap"),
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        # cached: the next access does not come here
        globals()[name] = value
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # lowcomm.strategies, as before
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

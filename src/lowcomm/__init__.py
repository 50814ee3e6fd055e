"""lowcomm: communication-efficient data-parallel training on torch.distributed.

The public names below are imported on first use (PEP 562): `lowcomm --help` and
`lowcomm --version` import this package, and must not wait seconds for torch.
"""
from __future__ import annotations

from .lazy.exports import lazy_exports

__version__ = "0.1.0"

# name -> the submodule that defines it, or (the submodule, its name there)
_EXPORTS = {
    "Comm": ".comm", "CommStats": ".comm", "RunConfig": ".config", "RunError": ".errors", "UsageError": ".errors",
    "GPT": ".models", "build_hf_causal_lm": ".models", "lm_loss": ".models",
    "RunDriver": ".run.driver", "make_run": ".run.driver",
    "make_strategy": (".run.driver", "make_run"),  # the name of lowcomm 0.1's builder
    "StepResult": ".strategies", "Strategy": ".strategies", "available": ".strategies", "wrap": ".run.wrap",
}
__all__ = [*_EXPORTS, "__version__"]
# lowcomm.strategies and the other folders without importing them first, as before
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), submodules=True)

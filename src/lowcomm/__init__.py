"""lowcomm: communication-efficient data-parallel training on torch.distributed."""
from .comm import Comm, CommStats
from .config import RunConfig
from .errors import RunError, UsageError
from .models import GPT, build_hf_causal_lm, lm_loss
from .strategies import StepResult, Strategy, available, make_strategy
from .wrap import Run, wrap

__version__ = "0.1.0"
__all__ = ["Comm", "CommStats", "RunConfig", "RunError", "UsageError", "GPT", "build_hf_causal_lm", "lm_loss",
           "Run", "StepResult", "Strategy", "available", "make_strategy", "wrap", "__version__"]

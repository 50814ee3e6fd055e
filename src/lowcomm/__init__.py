"""lowcomm: communication-efficient data-parallel training on torch.distributed."""
from .comm import Comm, CommStats
from .config import RunConfig
from .errors import RunError, UsageError
from .models import GPT, lm_loss
from .strategies import StepResult, Strategy, available, make_strategy

__version__ = "0.1.0"
__all__ = ["Comm", "CommStats", "RunConfig", "RunError", "UsageError", "GPT", "lm_loss",
           "StepResult", "Strategy", "available", "make_strategy", "__version__"]

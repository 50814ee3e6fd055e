"""lowcomm: communication-efficient data-parallel training on torch.distributed."""
from .comm import Comm, CommStats
from .config import RunConfig
from .errors import RunError, UsageError
from .models import GPT, build_hf_causal_lm, lm_loss
from .run import RunDriver, make_run
from .strategies import StepResult, Strategy, available
from .wrap import wrap

make_strategy = make_run  # the name of lowcomm 0.1's builder

__version__ = "0.1.0"
__all__ = ["Comm", "CommStats", "RunConfig", "RunError", "UsageError", "GPT", "build_hf_causal_lm", "lm_loss",
           "RunDriver", "StepResult", "Strategy", "available", "make_run", "make_strategy", "wrap", "__version__"]

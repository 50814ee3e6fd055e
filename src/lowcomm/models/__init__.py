from .gpt import GPT, lm_loss
from .hf import build_hf_causal_lm, hf_available  # transformers is imported lazily

__all__ = ["GPT", "lm_loss", "build_hf_causal_lm", "hf_available"]

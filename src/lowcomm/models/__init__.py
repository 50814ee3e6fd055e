"""The models: lowcomm's GPT (gpt.py), a transformers causal LM (hf.py), a model's tensors and
blocks as strategies see them (layout.py) and its size (size.py).

Imports: errors.
"""
from .gpt import GPT, lm_loss
from .hf import build_hf_causal_lm, hf_available  # transformers is imported lazily

__all__ = ["GPT", "lm_loss", "build_hf_causal_lm", "hf_available"]

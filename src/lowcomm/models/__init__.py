"""The models: lowcomm's GPT (gpt.py), a transformers causal LM (hf.py), a model's tensors and
blocks as strategies see them (layout.py) and its size (size.py); build.py builds a run's model from its settings;
load.py / hf_load.py read a saved model (--init-from, lowcomm sample), save.py writes a run's final
model (OUT/model/), sample.py generates text from one.

Imports: data (the vocabulary a run's model is sized to), storage (a saved model put in place whole), errors.
"""
from .gpt import GPT, lm_loss
from .hf import build_hf_causal_lm, hf_available  # transformers is imported lazily
from .build import build_model, build_run_model

__all__ = ["GPT", "lm_loss", "build_hf_causal_lm", "build_model", "build_run_model", "hf_available"]

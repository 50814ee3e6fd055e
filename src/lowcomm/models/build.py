"""The model a run trains, built from its model settings (config.ModelConfig, read by attribute:
models/ sits below config) and the vocabulary its data has."""
from __future__ import annotations

import torch

from .gpt import GPT
from .hf import build_hf_causal_lm


def build_model(model_cfg, vocab_size: int, seed: int, device: torch.device) -> torch.nn.Module:
    """lowcomm's GPT, or a transformers causal LM built from its config (`--model hf:<arch>`),
    initialised from `seed` (every rank builds the same θ0)."""
    torch.manual_seed(seed)
    n_layer, n_head, d_model = model_cfg.dims()
    if model_cfg.hf_architecture is not None:
        model = build_hf_causal_lm(model_cfg.hf_architecture, vocab_size=vocab_size, seq_len=model_cfg.seq_len,
                                   n_layer=n_layer, n_head=n_head, d_model=d_model)
    else:
        model = GPT(vocab_size, model_cfg.seq_len, n_layer, n_head, d_model)
    return model.to(device)

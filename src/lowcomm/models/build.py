"""The model a run trains, built from its model settings (config.ModelConfig, read by attribute:
models/ sits below config) and the vocabulary its data has: fresh from the seed, or the weights
of --init-from; then activation checkpointing and torch.compile where asked."""
from __future__ import annotations

import os
import shutil

import torch
import torch.nn as nn

from ..data.info import describe
from ..errors import UsageError
from .gpt import GPT
from .hf import build_hf_causal_lm
from .load import load_saved, read_saved


def build_model(model_cfg, vocab_size: int, seed: int, device: torch.device) -> torch.nn.Module:
    """lowcomm's GPT, or a transformers causal LM built from its config (`--model hf:<arch>`),
    initialised from `seed` (every rank builds the same θ0); with `model_cfg.init_from`, the
    model saved there, its weights loaded (every rank reads them: the same θ0 again), its dims
    and context its own. On the meta device nothing is read or compiled: the model is built
    only, and a setting it cannot honour is refused in one line."""
    torch.manual_seed(seed)
    if model_cfg.init_from:
        model = load_saved(read_saved(model_cfg.init_from, "--init-from"), device, vocab_size)
    else:
        n_layer, n_head, d_model = model_cfg.dims()
        if model_cfg.hf_architecture is not None:
            model = build_hf_causal_lm(model_cfg.hf_architecture, vocab_size=vocab_size, seq_len=model_cfg.seq_len,
                                       n_layer=n_layer, n_head=n_head, d_model=d_model)
        else:
            model = GPT(vocab_size, model_cfg.context, n_layer, n_head, d_model)
        model = model.to(device)
    if model_cfg.activation_checkpointing:
        checkpoint_activations(model)
    if model_cfg.compile:
        compile_model(model, torch.device(device))
    return model


def build_run_model(run, device: torch.device) -> torch.nn.Module:
    """The model of a run's settings (config.RunConfig, read by attribute) at its data's vocabulary
    (data.describe: byte text's 256, what token files declare, or --vocab-size), from its seed:
    what every rank of a run builds, and the planner on the meta device."""
    return build_model(run.model, describe(run.data.source, run.data.vocab_size).vocab_size, run.seed, device)


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each transformer block's activations in backward instead of keeping them:
    lowcomm's GPT checkpoints its blocks, a transformers model through its own switch."""
    if isinstance(model, GPT):
        model.checkpoint_blocks = True
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UsageError(f"--activation-checkpointing: the transformers model {type(model).__name__} does not "
                         f"support gradient checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None)  # its name from transformers 5 on
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_model(model: nn.Module, device: torch.device) -> None:
    """torch.compile the model in place (its state dict keeps its names), once the backend it
    needs is known to be there; on the meta device only that check."""
    refusal = compile_refusal("cuda" if device.type == "meta" and torch.cuda.is_available() else
                              "cpu" if device.type == "meta" else device.type)
    if refusal:
        raise UsageError(f"--compile: {refusal}")
    if device.type != "meta":
        model.compile()


def compile_refusal(device_type: str) -> str | None:
    """Why torch.compile's default backend (inductor) cannot run on `device_type` here, or None.
    On the CPU it compiles C++ with $CXX (g++ by default, as inductor looks it up); on CUDA it
    writes Triton kernels."""
    if device_type == "cuda":
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on CUDA needs triton, which is not installed (pip install triton), or leave it out"
        return None
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return (f"torch.compile on the CPU needs a C++ compiler, and '{compiler}' is not found (install g++, "
                f"or set CXX), or leave --compile out")
    return None

"""Weights to start from (`--init-from DIR`) and to sample from: what a model directory holds, and
the model it loads into.

A model directory is one of two kinds, told apart by its config.json:

* lowcomm's GPT, as a run leaves it (save.py): config.json says ``"architecture": "lowcomm_gpt"``
  and its dims; model.safetensors holds the weights (the tied output head left out);
* a Hugging Face ``save_pretrained`` directory (a run's hf: model, or any transformers causal LM
  saved with safetensors): its own config.json, read by transformers as saved.

`find_model_dir` also takes a run directory (OUT: its model/ is used) and a checkpoint
(OUT/ckpt-N: its model/, the model that step evaluated). Every refusal is one UsageError line
naming the directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import UsageError
from .gpt import GPT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LOWCOMM_GPT = "lowcomm_gpt"  # config.json's "architecture" for lowcomm's GPT
MODEL_DIR = "model"  # where a run leaves its final model: OUT/model
TIED = {"head.weight": "tok_emb.weight"}  # lowcomm GPT's output head is its token embedding


@dataclass(frozen=True)
class SavedModel:
    """What a model directory holds (read from its config.json, no weight read)."""
    path: Path
    architecture: str  # LOWCOMM_GPT, or a transformers model_type ("gpt2", "llama", ...)
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int
    context: int  # positions the model has (0: no limit, e.g. rotary models without a maximum)
    hf_config: object = None  # the transformers config, for a Hugging Face model

    @property
    def is_hf(self) -> bool:
        return self.architecture != LOWCOMM_GPT

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.n_layer, self.n_head, self.d_model

    def describe(self) -> str:
        kind = "lowcomm's GPT" if not self.is_hf else f"a transformers '{self.architecture}' model"
        return (f"{kind} ({_count(self.n_layer, 'layer')}, {_count(self.n_head, 'head')}, width {self.d_model}, "
                f"vocabulary {self.vocab_size}" + (f", context {self.context}" if self.context else "") + ")")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def find_model_dir(spec: str | Path, label: str = "model directory") -> Path:
    """The directory holding the model: `spec` itself, or `spec`/model (a run's output directory)."""
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise UsageError(f"{label} '{spec}' is not a directory")
    for candidate in (path, path / MODEL_DIR):
        if (candidate / CONFIG).is_file():
            return candidate
    checkpoints = sorted(c for c in path.glob("ckpt-*") if (c / MODEL_DIR / CONFIG).is_file())
    if checkpoints:
        raise UsageError(f"{label} '{spec}' is a run that left no final model ({MODEL_DIR}/ is written when it "
                         f"ends): give one of its checkpoints, the newest is {checkpoints[-1]}, or finish it "
                         f"with lowcomm train --resume {spec}")
    if any(path.glob("ckpt-*")):
        raise UsageError(f"{label} '{spec}' is a run that left no final model ({MODEL_DIR}/ is written when it "
                         f"ends; lowcomm train --resume {spec} finishes it)")
    raise UsageError(f"{label} '{spec}' holds no model: no {CONFIG} in it or in its {MODEL_DIR}/ (give a run's "
                     f"output directory, its {MODEL_DIR}/, or a save_pretrained directory)")


def read_saved(spec: str | Path, label: str = "model directory") -> SavedModel:
    """What the model directory `spec` (or the run directory holding it) holds."""
    path = find_model_dir(spec, label)
    try:
        raw = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{label} '{spec}': {path / CONFIG} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{label} '{spec}': {path / CONFIG} is not a JSON object")
    if raw.get("architecture") == LOWCOMM_GPT:
        return _lowcomm_saved(path, raw, label, spec)
    return _hf_saved(path, label, spec)


def _lowcomm_saved(path: Path, raw: dict, label: str, spec) -> SavedModel:
    keys = ("n_layer", "n_head", "d_model", "vocab_size", "context")
    bad = [k for k in keys if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool) or raw[k] < 1]
    if bad:
        raise UsageError(f"{label} '{spec}': {path / CONFIG} lacks a positive integer {bad[0]}")
    if not (path / WEIGHTS).is_file():
        raise UsageError(f"{label} '{spec}' holds no {WEIGHTS}")
    return SavedModel(path, LOWCOMM_GPT, *(raw[k] for k in keys))


def _hf_saved(path: Path, label: str, spec) -> SavedModel:
    from .hf_load import load_hf_config
    config = load_hf_config(path, f"{label} '{spec}'")
    if not any(path.glob("*.safetensors")):
        raise UsageError(f"{label} '{spec}' holds no safetensors weights (save them with save_pretrained; "
                         f"torch .bin files are not read)")
    return SavedModel(path, config.model_type, config.num_hidden_layers, config.num_attention_heads,
                      config.hidden_size, config.vocab_size, int(getattr(config, "max_position_embeddings", 0) or 0),
                      hf_config=config)


def load_saved(saved: SavedModel, device: torch.device, vocab_size: int | None = None) -> nn.Module:
    """The model `saved` describes, its weights loaded (on the meta device: built, nothing read),
    in train mode. `vocab_size`: the data's vocabulary, which the model's must equal."""
    if vocab_size is not None and saved.vocab_size != vocab_size:
        raise UsageError(f"'{saved.path}' holds a model with a vocabulary of {saved.vocab_size} tokens, but the "
                         f"data has {vocab_size}: train it on data made with its tokenizer")
    meta = torch.device(device).type == "meta"
    if saved.is_hf:
        from .hf_load import load_hf_causal_lm
        model = load_hf_causal_lm(saved.path, saved.hf_config, weights=not meta)
    else:
        model = GPT(saved.vocab_size, saved.context, saved.n_layer, saved.n_head, saved.d_model)
        if not meta:
            _load_gpt_weights(model, saved.path / WEIGHTS)
    return model.to(device).train()


def _load_gpt_weights(model: GPT, file: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        state = load_file(str(file))
    except (OSError, SafetensorError) as e:
        raise UsageError(f"'{file}' cannot be read: {e}") from None
    for tied, source in TIED.items():
        if source in state:
            state.setdefault(tied, state[source])
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        what = (f"lacks {missing[0]}" if missing else f"has an unknown tensor {unexpected[0]}" if unexpected
                else f"has {wrong[0]} of shape {list(state[wrong[0]].shape)}, not {list(expected[wrong[0]].shape)}")
        raise UsageError(f"'{file}' does not fit its config.json: it {what}")
    with torch.no_grad():
        model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})

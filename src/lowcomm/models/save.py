"""A run's final model, written where a user expects it (OUT/model/), in the form load.py and
transformers read back:

* lowcomm's GPT: model.safetensors (the tied output head left out: it is the token embedding)
  and config.json (``"architecture": "lowcomm_gpt"``, its dims, vocabulary, context, the
  sequence length it was trained at);
* a transformers model: ``save_pretrained`` (config.json, model.safetensors,
  generation_config.json), which ``AutoModelForCausalLM.from_pretrained`` loads;

with the files the caller adds (the tokenizer) beside them. The directory appears whole or not at
all: it is written under a temporary name beside it and renamed.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from ..storage.files import replace_directory
from .gpt import GPT
from .load import CONFIG, LOWCOMM_GPT, TIED, WEIGHTS

FORMAT_VERSION = 1


def unwrapped(model: nn.Module) -> nn.Module:
    """The model itself, under a torch.compile wrapper if it has one."""
    return getattr(model, "_orig_mod", model)


def full_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """The model's whole state dict on the CPU. Collective where FSDP shards the parameters
    (each DTensor gathered: every rank must call it); `keep=False` (not the rank that writes):
    gathered and dropped, None. Tensors the model ties stay one tensor."""
    from torch.distributed.tensor import DTensor
    model = unwrapped(model)
    # the module's own tensors under the state dict's names: a sharding engine's state-dict hook
    # may show each rank's shard there (engines/inside_fsdp.py: what a checkpoint keeps)
    named = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    state = {k: named.get(k, v) for k, v in model.state_dict().items()}
    sharded = any(isinstance(v, DTensor) for v in state.values())
    if not sharded and not keep:
        return None
    out, seen = {}, {}
    for key, value in state.items():
        if id(value) not in seen:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            seen[id(value)] = full.detach().to("cpu", copy=True)
        out[key] = seen[id(value)]
    return out if keep else None


def save_model(model: nn.Module, state: dict[str, torch.Tensor], directory: Path, seq_len: int,
               files: dict[str, bytes | Path] | None = None) -> Path:
    """Write `model` with the weights `state` (full_state's) to `directory`, atomically, with
    `files` (name -> bytes, or a file to copy) beside it. Returns `directory`."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        inner = unwrapped(model)
        if isinstance(inner, GPT):
            _save_gpt(inner, state, tmp, seq_len)
        else:
            from .hf_load import no_progress_bars
            with no_progress_bars():
                inner.save_pretrained(str(tmp), state_dict=state)
        for name, content in (files or {}).items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                shutil.copyfile(content, tmp / name)
        _readable_as(tmp / CONFIG, tmp)
        replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def gpt_config(model: GPT, seq_len: int) -> dict:
    """config.json of lowcomm's GPT: what load.py rebuilds it from."""
    return {"architecture": LOWCOMM_GPT, "format_version": FORMAT_VERSION,
            "vocab_size": model.tok_emb.num_embeddings, "n_layer": len(model.blocks),
            "n_head": model.blocks[0].attn.n_head if len(model.blocks) else 1, "d_model": model.tok_emb.embedding_dim,
            "context": model.pos_emb.num_embeddings, "seq_len": seq_len, "tied": dict(TIED)}


def _save_gpt(model: GPT, state: dict, directory: Path, seq_len: int) -> None:
    from safetensors.torch import save_file
    weights = {k: v.contiguous() for k, v in state.items() if k not in TIED}
    save_file(weights, str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / CONFIG).write_text(json.dumps(gpt_config(model, seq_len), indent=2) + "\n")


def _readable_as(reference: Path, directory: Path) -> None:
    """Every file in `directory` with `reference`'s mode (what the umask gives a new file):
    safetensors writes its file private (0600), which a shared run directory's readers cannot open."""
    mode = reference.stat().st_mode & 0o777
    for f in directory.iterdir():
        os.chmod(f, mode)

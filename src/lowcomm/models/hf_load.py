"""A transformers causal LM loaded from a ``save_pretrained`` directory (``--init-from DIR``), read
locally (nothing is downloaded) with the config as saved, but for dropout, which is turned off as
in every model lowcomm builds (hf.py says why), and the generation cache, which training never
uses. Weights are loaded in float32: the parameters every strategy keeps."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import UsageError
from .hf import _DROPOUT_RE, _import_transformers, _one_line


def load_hf_config(path: Path, where: str):
    """The config of the save_pretrained directory `path`, dropout off; `where` names it in a refusal."""
    auto_config, _, _, causal = _import_transformers()
    try:
        config = auto_config.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, KeyError... with long texts
        raise UsageError(f"{where}: its config.json is not a model transformers reads: {_one_line(e)}") from None
    if config.model_type not in causal:
        raise UsageError(f"{where} holds a transformers '{config.model_type}' model, not a causal language model")
    for key, value in config.to_dict().items():
        if _DROPOUT_RE.search(key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.use_cache = False
    return config


def load_hf_causal_lm(path: Path, config, weights: bool = True) -> nn.Module:
    """The model of `config`, with the weights saved in `path` (`weights=False`: built only, e.g.
    on the meta device). A weight the model lacks or whose shape differs is refused, never left
    at random."""
    _, auto_model, _, _ = _import_transformers()
    if not weights:
        return auto_model.from_config(config)
    try:
        with no_progress_bars():
            model, info = auto_model.from_pretrained(str(path), config=config, dtype=torch.float32,
                                                     local_files_only=True, use_safetensors=True,
                                                     output_loading_info=True)
    except Exception as e:
        raise UsageError(f"'{path}': its weights do not load into its config's model: {_one_line(e)}") from None
    missing, mismatched = info.get("missing_keys") or [], info.get("mismatched_keys") or []
    if missing or mismatched:
        what = f"lack {sorted(missing)[0]}" if missing else f"have {mismatched[0][0]} of another shape"
        raise UsageError(f"'{path}': its weights {what} (the config.json and the safetensors do not match)")
    return model


@contextmanager
def no_progress_bars():
    """transformers' loading and writing bars, off: a run's output is its own progress line."""
    from transformers.utils import logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()

"""Causal language models from Hugging Face ``transformers``, built from a config.

This is the optional ``hf`` extra (``pip install 'lowcomm[hf]'``). Nothing here
downloads anything: a model is built *by config* only, with freshly initialised
weights, from the same dimensions the CLI uses for lowcomm's own GPT::

    torch.manual_seed(0)
    model = build_hf_causal_lm("llama", vocab_size=256, seq_len=128,
                               n_layer=4, n_head=4, d_model=144)
    loss = lm_loss(model, (x, y))

``transformers`` is imported lazily, inside :func:`build_hf_causal_lm`, so
``import lowcomm`` never pays for (or requires) it.
"""
from __future__ import annotations

import difflib
import importlib.util
import re
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..errors import UsageError

__all__ = ["build_hf_causal_lm", "hf_available"]

_INSTALL_HINT = "pip install 'lowcomm[hf]' (or: pip install transformers)"

# Architectures shown first when an error lists "known" ones.
_SUGGESTED = ("gpt2", "llama", "gpt_neox", "qwen2", "mistral", "phi", "gemma", "opt")

# Config fields (where a config has them) that hold the MLP width. Llama-like
# defaults are huge (11008, 14336, ...), so they are set to 4 * d_model, the
# width lowcomm's own GPT uses.
_MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size",
                   "decoder_ffn_dim")
# Key/value head counts: set to n_head (plain multi-head attention, like
# lowcomm's GPT); many defaults (qwen2: 32, mistral: 8) would not divide a small n_head.
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads")
# Dropout-like probabilities: every float field whose name matches is set to 0.0.
_DROPOUT_RE = re.compile(r"dropout|pdrop|layerdrop")
# Special-token ids: byte-level data has none, so ids outside the vocabulary
# (gpt2's 50256, ...) are cleared rather than left dangling, and so is any
# pad_token_id: it becomes the embedding's padding_idx, whose row is zero and
# never trained (opt, bart: byte 0x01; gemma: byte 0x00).
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# Encoder-decoder families (bart, mbart, ...) whose causal LM is the decoder.
_DECODER_DIM_KEYS = {"decoder_layers": "n_layer", "decoder_attention_heads": "n_head"}
# Sub-configs that only describe parts of a layer (mpt, dbrx); any other
# sub-config (text_config, vision_config, ...) marks a composite (multimodal)
# model, whose text model the dims would not reach.
_LAYER_PART_SUBCONFIGS = frozenset({"attn_config", "ffn_config"})
# Accepted in **overrides even though a config does not expose them as attributes.
_EXTRA_OVERRIDE_KEYS = frozenset({"attn_implementation"})
# The core dims under their standard config names, and the argument that sets each.
_CORE_ARGS = {"vocab_size": "vocab_size", "max_position_embeddings": "seq_len",
              "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
              "hidden_size": "d_model"}


def hf_available() -> bool:
    """True when ``transformers`` is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def _import_transformers():
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:
        raise UsageError(f"Hugging Face models need transformers, which is not installed "
                         f"or failed to import ({e}); {_INSTALL_HINT}") from None
    return AutoConfig, AutoModelForCausalLM, CONFIG_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _known(causal: dict) -> str:
    first = [a for a in _SUGGESTED if a in causal]
    rest = sorted(a for a in causal if a not in first)
    shown = first + rest[: max(0, 8 - len(first))]
    return f"{', '.join(shown)}, ... ({len(causal)} in all)"


def _resolve_architecture(architecture: str, config_mapping, causal: dict) -> str:
    """The ``model_type`` for ``architecture``: a model type ("gpt2", "llama"),
    case-insensitively, or a causal-LM class name ("LlamaForCausalLM")."""
    if not isinstance(architecture, str) or not architecture.strip():
        raise UsageError(f"Hugging Face architecture must be a non-empty name such as "
                         f"'gpt2' or 'llama', got {architecture!r}")
    name = architecture.strip()
    model_types = list(config_mapping.keys())
    if name in model_types:
        resolved = name
    else:
        by_lower = {t.lower(): t for t in model_types}
        by_class = {cls.lower(): t for t, cls in causal.items() if isinstance(cls, str)}
        key = name.lower()
        resolved = by_lower.get(key) or by_lower.get(key.replace("-", "_")) \
            or by_lower.get(key.replace("_", "-")) or by_class.get(key)
    if resolved is None:
        close = difflib.get_close_matches(name.lower(), model_types, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise UsageError(f"unknown Hugging Face architecture {architecture!r}{hint}; "
                         f"known causal LMs include {_known(causal)}")
    if resolved not in causal:
        raise UsageError(f"Hugging Face architecture {resolved!r} is not a causal language "
                         f"model (transformers has no AutoModelForCausalLM for it); "
                         f"causal LMs include {_known(causal)}")
    return resolved


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    # Strict-dataclass validation errors put the useful part on a later line.
    text = " ".join(lines[:3]) if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def build_hf_causal_lm(architecture: str, *, vocab_size: int, seq_len: int, n_layer: int,
                       n_head: int, d_model: int, **overrides: Any) -> nn.Module:
    """Build a freshly initialised ``transformers`` causal LM from a config.

    ``architecture`` is a transformers model type (``"gpt2"``, ``"llama"``,
    ``"gpt_neox"``, ``"qwen2"``, ...; case-insensitive) or a causal-LM class name
    (``"LlamaForCausalLM"``). No weights are loaded and nothing is downloaded:
    the model comes from ``AutoConfig.for_model(...)`` and
    ``AutoModelForCausalLM.from_config(...)``.

    The dimensions are those of lowcomm's own GPT and are passed under the
    standard config names (transformers' ``attribute_map`` translates them, e.g.
    to GPT-2's ``n_embd``/``n_layer``/``n_head``/``n_positions``):

    * ``vocab_size`` -> ``vocab_size`` (256 for lowcomm's byte-level data),
    * ``seq_len`` -> ``max_position_embeddings``,
    * ``n_layer`` -> ``num_hidden_layers``, ``n_head`` -> ``num_attention_heads``,
      ``d_model`` -> ``hidden_size``.

    Where the architecture's config has them, these are also set so that the
    model's size reflects the dims rather than the (large) published defaults:
    the MLP width (``intermediate_size``, ``n_inner``, ``ffn_dim``, ...) to
    ``4 * d_model``; key/value heads (``num_key_value_heads``) to ``n_head``;
    ``head_dim`` to ``d_model // n_head``; for encoder-decoder families
    (bart, ...) ``decoder_layers``/``decoder_attention_heads``; ``rotary_dim``
    (gptj, codegen) scaled to the new head size. Special-token ids outside the
    vocabulary are cleared, as is ``pad_token_id`` (it would become an
    embedding ``padding_idx``: one byte's embedding fixed at zero); and
    ``use_cache=False``. Composite (multimodal) models are refused; use
    their ``*_text`` architecture.

    **Dropout is off**: every dropout probability the config has
    (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``, ``hidden_dropout``,
    ``attention_dropout``, ``dropout``, ``layerdrop``, ...) is set to 0.0, so
    training is deterministic and comparable with lowcomm's GPT, which has no
    dropout. Whether the model is in train or eval mode is the caller's
    business (transformers returns it in train mode).

    Any other config-level value can be given in ``overrides`` (e.g.
    ``tie_word_embeddings=True``, ``intermediate_size=512``,
    ``attn_pdrop=0.1``, ``attn_implementation="eager"``); overrides win over the
    values above. The core dims must be given through the keyword arguments,
    not overrides.

    Weights are initialised with torch's global RNG: seed it
    (``torch.manual_seed``) before calling, and two builds give identical
    parameters. Parameters are float32 (torch's default dtype).

    Every failure is a one-line :class:`lowcomm.errors.UsageError`:
    transformers missing, unknown or non-causal architecture, dims or
    overrides the model rejects.
    """
    dims = _checked_dims(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                         d_model=d_model)
    auto_config, auto_model, config_mapping, causal = _import_transformers()
    model_type = _resolve_architecture(architecture, config_mapping, causal)
    base = _defaults_of(model_type, config_mapping[model_type], causal)
    _check_overrides(base, overrides)
    config = _make_config(auto_config, base, dims, overrides)
    return _make_model(auto_model, config, base.where, dims)


def _checked_dims(**dims: int) -> dict[str, int]:
    for name, value in dims.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"Hugging Face model: {name} must be a positive integer, got {value!r}")
    if dims["d_model"] % dims["n_head"]:
        raise UsageError(f"Hugging Face model: d_model={dims['d_model']} is not divisible by "
                         f"n_head={dims['n_head']}")
    return dims


@dataclass
class _Defaults:
    """An architecture's default config: which fields it has, under which names."""

    model_type: str
    config: Any  # the config class's defaults
    amap: dict  # attribute_map: standard name -> this config's field name
    values: dict  # config.to_dict()

    @property
    def where(self) -> str:
        return _where(self.model_type)

    def field(self, key: str) -> str:
        return self.amap.get(key, key)

    def is_field(self, key: str) -> bool:  # a plain config field (not a computed property)
        return self.field(key) in self.values

    def has(self, key: str) -> bool:
        return self.is_field(key) or hasattr(self.config, key)


def _where(model_type: str) -> str:
    return f"Hugging Face {model_type!r} model"


def _defaults_of(model_type: str, config_cls, causal: dict) -> _Defaults:
    """The default config of `model_type`; composite (multimodal) models are refused."""
    try:
        defaults = config_cls()
    except Exception as e:  # a config class that cannot even build its defaults
        raise UsageError(f"cannot build a {_where(model_type)}: its default config fails: "
                         f"{_one_line(e)}") from None
    sub_configs = set(getattr(config_cls, "sub_configs", None) or ())
    if hasattr(defaults, "text_config"):
        sub_configs.add("text_config")
    if sub_configs - _LAYER_PART_SUBCONFIGS:
        text = [t for t in (f"{model_type}_text", f"{model_type}_text_model") if t in causal]
        hint = f"; use {text[0]!r} for its text model" if text else ""
        raise UsageError(f"Hugging Face architecture {model_type!r} is a composite "
                         f"(multimodal) model whose text model the dims would not reach"
                         f"{hint}")
    amap = dict(getattr(defaults, "attribute_map", {}) or {})
    return _Defaults(model_type, defaults, amap, defaults.to_dict())


def _check_overrides(base: _Defaults, overrides: dict) -> None:
    """Overrides may not set the core dims (under any alias) and must name config fields."""
    core_fields = {base.field(k): k for k in _CORE_ARGS}
    for key in overrides:
        target = base.field(key)
        if target in core_fields or key in _CORE_ARGS:
            std = core_fields.get(target, key)
            raise UsageError(f"{base.where}: set {std} through {_CORE_ARGS[std]}=..., not as an "
                             f"override ({key}={overrides[key]!r})")
        if not base.has(key) and key not in _EXTRA_OVERRIDE_KEYS:
            close = difflib.get_close_matches(key, list(base.values) + list(base.amap), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{base.where}: unknown config override {key!r}{hint}")


def _config_kwargs(base: _Defaults, dims: dict) -> tuple[dict[str, Any], list[str]]:
    """The config values lowcomm sets (before overrides), and the token ids it cleared."""
    kwargs: dict[str, Any] = {std: dims[arg] for std, arg in _CORE_ARGS.items()}
    kwargs.update(_size_kwargs(base, dims))
    for key, value in base.values.items():
        if _DROPOUT_RE.search(key) and isinstance(value, float) and not isinstance(value, bool):
            kwargs[key] = 0.0
    cleared = []
    for key in _TOKEN_ID_KEYS:
        value = base.values.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and (
                key == "pad_token_id" or not 0 <= value < dims["vocab_size"]):
            kwargs[key] = None
            cleared.append(key)
    kwargs["use_cache"] = False
    # Encoder families that transformers also maps to causal LMs (bert, roberta, ...) attend
    # both ways unless told they are decoders: a "causal" LM that sees the next token.
    kwargs["is_decoder"] = True
    return kwargs, cleared


def _size_kwargs(base: _Defaults, dims: dict) -> dict[str, Any]:
    """The widths that follow from the dims where the config has them (MLP, kv heads,
    decoder depth, head_dim, rotary_dim), so the published defaults do not size the model."""
    d_model, n_head = dims["d_model"], dims["n_head"]
    kwargs: dict[str, Any] = {}
    for key in _MLP_WIDTH_KEYS:
        if base.is_field(key):
            kwargs[key] = 4 * d_model
    for key in _KV_HEAD_KEYS:
        if base.is_field(key):
            kwargs[key] = n_head
    for key, arg in _DECODER_DIM_KEYS.items():
        if base.is_field(key):
            kwargs[key] = dims[arg]
    head_dim = d_model // n_head
    if base.is_field("head_dim"):
        kwargs["head_dim"] = head_dim
    rotary_dim = base.values.get("rotary_dim")
    if isinstance(rotary_dim, int) and rotary_dim > 0:
        # gptj/codegen rotate a fixed number of dims per head (64 of 256 by
        # default); keep the published fraction of the new head_dim.
        d_hidden = base.values.get(base.field("hidden_size"))
        d_heads = base.values.get(base.field("num_attention_heads"))
        frac = rotary_dim * d_heads / d_hidden if d_hidden and d_heads else 1.0
        kwargs["rotary_dim"] = max(2, min(head_dim, 2 * round(frac * head_dim / 2)))
    return kwargs


def _with_overrides(base: _Defaults, kwargs: dict, overrides: dict) -> dict:
    """`kwargs` updated by `overrides`; an override replaces a value set under any alias."""
    kwargs = dict(kwargs)
    for key in overrides:
        target = base.field(key)
        for k in [k for k in kwargs if k != key and base.field(k) == target]:
            del kwargs[k]
    kwargs.update(overrides)
    return kwargs


def _make_config(auto_config, base: _Defaults, dims: dict, overrides: dict):
    """The model's config, with lowcomm's values and the overrides; checked for kv heads."""
    kwargs, cleared = _config_kwargs(base, dims)
    kwargs = _with_overrides(base, kwargs, overrides)
    try:
        try:
            config = auto_config.for_model(base.model_type, **kwargs)
        except Exception:
            # Some configs insist on integer token ids; then keep the defaults.
            retry = {k: v for k, v in kwargs.items() if k not in cleared or k in overrides}
            if len(retry) == len(kwargs):
                raise
            config = auto_config.for_model(base.model_type, **retry)
    except Exception as e:
        raise UsageError(f"{base.where} rejects its config ({_shown(dims)}): {_one_line(e)}") from None
    for key in _KV_HEAD_KEYS:
        kv = getattr(config, key, None)
        if isinstance(kv, int) and kv > 0 and dims["n_head"] % kv:
            raise UsageError(f"{base.where}: n_head={dims['n_head']} is not divisible by {key}={kv}")
    return config


def _make_model(auto_model, config, where: str, dims: dict) -> nn.Module:
    try:
        return auto_model.from_config(config)
    except Exception as e:
        raise UsageError(f"cannot build a {where} ({_shown(dims)}): {_one_line(e)}") from None


def _shown(dims: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())

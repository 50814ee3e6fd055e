"""Validation: every value checked once it is all set, so the CLI, a TOML file and the Python
API refuse the same bad value with the same one-line message, the first bad one in this order."""
from __future__ import annotations

import functools

from ..comm.link import format_duration
from ..errors import UsageError
from ..strategies import registry
from ..engines.inside import check_layout
from ..contract.values import format_numbers
from .schema import (BACKENDS, DEVICES, MAX_TIMEOUT_S, MODEL_PRESETS, PRECISIONS, SCHEDULES, DataConfig,
                     ModelConfig, OptimConfig, RunConfig)
from .setting import resolve_options, spelled


def validate(cfg: RunConfig, strategies: list[str] | None = None) -> None:
    """Check every value; raise UsageError naming the first bad one."""
    strategies = registry.available() if strategies is None else strategies
    if cfg.strategy not in strategies:
        raise UsageError(
            f"unknown strategy '{cfg.strategy}' (choose from: {', '.join(sorted(strategies))})")
    _check_run(cfg)
    _apply_strategy_options(cfg)
    cfg.strategy_options().check_length(cfg.steps)
    _check_links(cfg)
    check_replicas(cfg, [n for n in strategies if registry.get(n).runs_inside(cfg.inside)])
    _check_placement(cfg)
    check_precision(cfg)
    _check_model(cfg)
    _check_data(cfg)
    _check_optim(cfg)


def check_replicas(cfg, supported: list[str]) -> None:
    """UsageError (one line) unless --replicas, --inside, --intra-link and the strategy of `cfg`
    (config.RunConfig) fit together (`supported`: the strategies that run under its --inside)."""
    from .nodes import under_torchrun
    check_layout(cfg.workers, cfg.replicas, cfg.inside, cfg.strategy, supported, spell=functools.partial(spelled, cfg),
                 intra_link=cfg.intra_link.bandwidth is not None, one_replica=cfg.elastic and under_torchrun())


def _value(cfg: RunConfig, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


def _positive(cfg: RunConfig, *keys: str) -> None:
    """Each setting of `keys` (config keys) is positive; a refusal names it as the user wrote it."""
    for key in keys:
        if _value(cfg, key) <= 0:
            raise UsageError(f"{spelled(cfg, key)} must be positive, got {_value(cfg, key)}")


def _non_negative(cfg: RunConfig, *keys: str) -> None:
    for key in keys:
        if _value(cfg, key) < 0:
            raise UsageError(f"{spelled(cfg, key)} must not be negative, got {_value(cfg, key)}")


def _check_run(cfg: RunConfig) -> None:
    """The run's counts and its collective timeout."""
    if cfg.workers < 1:
        raise UsageError(f"{spelled(cfg, 'workers')} must be at least 1, got {cfg.workers}")
    _positive(cfg, "steps", "micro_batch", "accum")
    _non_negative(cfg, "seed", "eval_every")
    _positive(cfg, "eval_batches", "threads", "log_every")
    _non_negative(cfg, "checkpoint_every", "stop_at", "max_restarts")
    _positive(cfg, "keep", "max_bad_steps", "timeout")
    if cfg.timeout > MAX_TIMEOUT_S:  # beyond what a timedelta (and gloo's milliseconds) can hold
        raise UsageError(f"{spelled(cfg, 'timeout')} must be at most {MAX_TIMEOUT_S:.0f} seconds (a year), "
                         f"got {cfg.timeout:g}")


def _apply_strategy_options(cfg: RunConfig) -> None:
    """The chosen strategy's options, checked; an older spelling renamed to what runs."""
    resolve_options(cfg)
    name, options = registry.resolve(cfg.strategy, cfg.strategy_options())
    if name != cfg.strategy:  # an older spelling (quantized --bits 1): the run is named what runs
        cfg.options.pop(cfg.strategy)  # and its table is the new name's (no other strategy's is left)
        cfg.strategy, cfg.options[name] = name, options
        options.check_run(cfg)


def _check_links(cfg: RunConfig) -> None:
    """A latency or jitter means nothing without a bandwidth (no bandwidth: no emulation)."""
    for table in ("link", "intra_link"):
        for key in ("latency", "jitter") if getattr(cfg, table).bandwidth is None else ():
            value = getattr(getattr(cfg, table), key)
            if value:
                raise UsageError(f"{spelled(cfg, f'{table}.{key}')} '{format_duration(value)}' needs a link bandwidth too "
                                 f"(e.g. --{table.replace('_', '-')} inf,{format_duration(value)} for latency only)")


def _check_placement(cfg: RunConfig) -> None:
    """Where the workers run: one slowdown factor each, a known backend and device that fit."""
    if cfg.slowdown and len(cfg.slowdown) != cfg.workers:
        raise UsageError(f"{spelled(cfg, 'slowdown')} '{format_numbers(cfg.slowdown)}' has {len(cfg.slowdown)} "
                         f"factor(s) but there are {cfg.workers} workers ({spelled(cfg, 'workers', cfg.workers)}; "
                         f"give one factor per worker)")
    if cfg.backend not in BACKENDS:
        raise UsageError(f"unknown {spelled(cfg, 'backend')} '{cfg.backend}' (choose from: {', '.join(BACKENDS)})")
    if cfg.device not in DEVICES:
        raise UsageError(f"unknown {spelled(cfg, 'device')} '{cfg.device}' (choose from: {', '.join(DEVICES)})")
    if cfg.precision not in PRECISIONS:
        raise UsageError(f"unknown {spelled(cfg, 'precision')} '{cfg.precision}' (choose from: "
                         f"{', '.join(PRECISIONS)})")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise UsageError(f"{spelled(cfg, 'backend', 'nccl')} needs {spelled(cfg, 'device', 'cuda')}, got "
                         f"{spelled(cfg, 'device', 'cpu')}")


def check_precision(cfg: RunConfig) -> None:
    """--precision fp16 computes on CUDA only (its loss scaler exists for fp16's range; a CPU's
    autocast is bf16's), and not with FSDP inside a replica (run/precision.py says why)."""
    if cfg.precision != "fp16":
        return
    import torch  # only here: validating a config otherwise imports no torch
    if cfg.device == "cpu" or not torch.cuda.is_available():
        where = spelled(cfg, "device", "cpu") if cfg.device == "cpu" else "this machine has no CUDA device"
        raise UsageError(f"{spelled(cfg, 'precision', 'fp16')} needs CUDA ({where}): use "
                         f"{spelled(cfg, 'precision', 'bf16')} on a CPU")
    if cfg.inside == "fsdp" and (cfg.replicas or cfg.workers) < cfg.workers:
        raise UsageError(f"{spelled(cfg, 'precision', 'fp16')} does not run with {spelled(cfg, 'inside', 'fsdp')}: "
                         f"use {spelled(cfg, 'precision', 'bf16')}")


def _check_model(cfg: RunConfig) -> None:
    m: ModelConfig = cfg.model
    if m.hf_architecture is not None:
        if not m.hf_architecture:
            raise UsageError(f"{spelled(cfg, 'model.preset')} '{m.preset}' names no architecture (e.g. hf:gpt2, "
                             f"hf:llama)")
    elif m.preset not in MODEL_PRESETS:
        raise UsageError(f"unknown {spelled(cfg, 'model.preset')} '{m.preset}' (choose from: "
                         f"{', '.join(MODEL_PRESETS)}, or hf:<architecture>)")
    _non_negative(cfg, "model.n_layer", "model.n_head", "model.d_model")
    _positive(cfg, "model.seq_len")
    if m.init_from:
        _check_init_from(cfg)
    n_layer, n_head, d_model = m.dims()
    if d_model % n_head:
        raise UsageError(f"{spelled(cfg, 'model.d_model', d_model)} must be divisible by "
                         f"{spelled(cfg, 'model.n_head', n_head)}")
    if not m.init_from and m.hf_architecture is None and m.seq_len > m.context:
        raise UsageError(f"{spelled(cfg, 'model.seq_len', m.seq_len)} is longer than the context of "
                         f"{spelled(cfg, 'model.preset', m.preset)} ({m.context} positions)")


_DIMS = {"model.n_layer": "layers", "model.n_head": "heads", "model.d_model": "width"}


def _check_init_from(cfg: RunConfig) -> None:
    """--init-from DIR sets the model: its kind (--model), its dims and its context come from DIR.
    A --model, --n-layer, --n-head or --d-model given that disagrees is refused; those left out
    are filled in from DIR, so everything that reads the config (memory check, summary) sees the
    model that runs. --seq-len may not exceed the saved model's context (not given: cut to it)."""
    from ..models.load import read_saved  # models is imported only here: reading DIR's config.json
    m, where = cfg.model, f"{spelled(cfg, 'model.init_from')} '{cfg.model.init_from}'"
    saved = read_saved(m.init_from, spelled(cfg, "model.init_from"))
    given_preset = "model.preset" in cfg.written_as
    wanted = f"hf:{saved.architecture}" if saved.is_hf else None
    named = (m.hf_architecture or "").lower().replace("-", "_") or None  # hf:GPT2 names gpt2
    if given_preset and named != (saved.architecture if saved.is_hf else None):
        hint = f"--model {wanted}" if wanted else "a lowcomm preset"
        raise UsageError(f"{spelled(cfg, 'model.preset', m.preset)} disagrees with {where}, which holds "
                         f"{saved.describe()} (give {hint}, or leave --model out)")
    if given_preset and not saved.is_hf and not (m.n_layer or m.n_head or m.d_model) and \
            MODEL_PRESETS[m.preset] != saved.dims:
        raise UsageError(f"{spelled(cfg, 'model.preset', m.preset)} ({', '.join(map(str, MODEL_PRESETS[m.preset]))}"
                         f") disagrees with {where}, which holds {saved.describe()} (leave --model out)")
    for (key, name), have in zip(_DIMS.items(), saved.dims):
        given = _value(cfg, key)
        if given and given != have:
            raise UsageError(f"{spelled(cfg, key, given)} disagrees with {where}, which holds {saved.describe()} "
                             f"(leave it out: --init-from sets the {name})")
        setattr(m, key.split(".")[1], have)
    if wanted:
        m.preset = wanted
    if saved.context and m.seq_len > saved.context:
        if "model.seq_len" not in cfg.written_as:  # the default sequence, cut to what the model takes
            m.seq_len = saved.context
        else:
            raise UsageError(f"{spelled(cfg, 'model.seq_len', m.seq_len)} is longer than the model in {where} "
                             f"takes (a context of {saved.context} positions)")


def _check_data(cfg: RunConfig) -> None:
    d: DataConfig = cfg.data
    if not d.source.strip():
        raise UsageError(f"{spelled(cfg, 'data.source')} must not be empty")
    _non_negative(cfg, "data.vocab_size")
    if not 0 < d.val_fraction < 1:
        raise UsageError(f"{spelled(cfg, 'data.val_fraction')} must be between 0 and 1, got {d.val_fraction}")


def _check_optim(cfg: RunConfig) -> None:
    o: OptimConfig = cfg.optim
    _positive(cfg, "optim.lr")
    _non_negative(cfg, "optim.weight_decay")
    for key in ("optim.beta1", "optim.beta2"):
        if not 0 <= _value(cfg, key) < 1:
            raise UsageError(f"{spelled(cfg, key)} must be in [0, 1), got {_value(cfg, key)}")
    _positive(cfg, "optim.eps")
    _non_negative(cfg, "optim.warmup_steps")
    if o.schedule not in SCHEDULES:
        raise UsageError(f"unknown {spelled(cfg, 'optim.schedule')} '{o.schedule}' (choose from: "
                         f"{', '.join(SCHEDULES)})")
    if not 0 <= o.min_lr_ratio <= 1:
        raise UsageError(f"{spelled(cfg, 'optim.min_lr_ratio')} must be in [0, 1], got {o.min_lr_ratio}")

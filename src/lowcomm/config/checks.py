"""Validation: every value checked once it is all set, so the CLI, a TOML file and the Python
API refuse the same bad value with the same one-line message, the first bad one in this order."""
from __future__ import annotations

from ..comm.link import format_duration
from ..errors import UsageError
from ..strategies import registry
from ..engines.inside import check_layout
from ..contract.values import format_numbers
from .schema import (BACKENDS, DEVICES, MAX_TIMEOUT_S, MODEL_PRESETS, SCHEDULES, DataConfig,
                     ModelConfig, OptimConfig, RunConfig)
from .setting import resolve_options


def validate(cfg: RunConfig, strategies: list[str] | None = None) -> None:
    """Check every value; raise UsageError naming the first bad one."""
    strategies = registry.available() if strategies is None else strategies
    if cfg.strategy not in strategies:
        raise UsageError(
            f"unknown strategy '{cfg.strategy}' (choose from: {', '.join(sorted(strategies))})")
    _check_run(cfg)
    _apply_strategy_options(cfg)
    _check_links(cfg)
    check_replicas(cfg, [n for n in strategies if registry.get(n).runs_inside(cfg.inside)])
    _check_placement(cfg)
    _check_model(cfg.model)
    _check_data(cfg.data)
    _check_optim(cfg.optim)


def check_replicas(cfg, supported: list[str]) -> None:
    """UsageError (one line) unless --replicas, --inside, --intra-link and the strategy of `cfg`
    (config.RunConfig) fit together (`supported`: the strategies that run under its --inside)."""
    from .nodes import under_torchrun
    check_layout(cfg.workers, cfg.replicas, cfg.inside, cfg.strategy, supported,
                 intra_link=cfg.intra_link.bandwidth is not None, one_replica=cfg.elastic and under_torchrun())


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise UsageError(f"{name} must be positive, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise UsageError(f"{name} must not be negative, got {value}")


def _check_run(cfg: RunConfig) -> None:
    """The run's counts and its collective timeout."""
    if cfg.workers < 1:
        raise UsageError(f"workers must be at least 1, got {cfg.workers}")
    _positive("steps", cfg.steps)
    _positive("micro_batch", cfg.micro_batch)
    _positive("accum", cfg.accum)
    _non_negative("seed", cfg.seed)
    _non_negative("eval_every", cfg.eval_every)
    _positive("eval_batches", cfg.eval_batches)
    _positive("threads", cfg.threads)
    _positive("log_every", cfg.log_every)
    for name in ("checkpoint_every", "stop_at", "max_restarts"):
        _non_negative(name, getattr(cfg, name))
    _positive("keep", cfg.keep)
    _positive("max_bad_steps", cfg.max_bad_steps)
    _positive("timeout", cfg.timeout)
    if cfg.timeout > MAX_TIMEOUT_S:  # beyond what a timedelta (and gloo's milliseconds) can hold
        raise UsageError(f"timeout must be at most {MAX_TIMEOUT_S:.0f} seconds (a year), got {cfg.timeout:g}")


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
                raise UsageError(f"{table}.{key} '{format_duration(value)}' needs a link bandwidth too "
                                 f"(e.g. --{table.replace('_', '-')} inf,{format_duration(value)} for latency only)")


def _check_placement(cfg: RunConfig) -> None:
    """Where the workers run: one slowdown factor each, a known backend and device that fit."""
    if cfg.slowdown and len(cfg.slowdown) != cfg.workers:
        raise UsageError(f"slowdown '{format_numbers(cfg.slowdown)}' has {len(cfg.slowdown)} factor(s) but "
                         f"there are {cfg.workers} workers (give one per worker)")
    if cfg.backend not in BACKENDS:
        raise UsageError(f"unknown backend '{cfg.backend}' (choose from: {', '.join(BACKENDS)})")
    if cfg.device not in DEVICES:
        raise UsageError(f"unknown device '{cfg.device}' (choose from: {', '.join(DEVICES)})")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise UsageError("backend 'nccl' needs device 'cuda', got device 'cpu'")


def _check_model(m: ModelConfig) -> None:
    if m.hf_architecture is not None:
        if not m.hf_architecture:
            raise UsageError(f"model '{m.preset}' names no architecture (e.g. hf:gpt2, hf:llama)")
    elif m.preset not in MODEL_PRESETS:
        raise UsageError(
            f"unknown model preset '{m.preset}' (choose from: {', '.join(MODEL_PRESETS)}, or hf:<architecture>)")
    for name in ("n_layer", "n_head", "d_model"):
        _non_negative(f"model.{name}", getattr(m, name))
    _positive("seq_len", m.seq_len)
    n_layer, n_head, d_model = m.dims()
    if d_model % n_head:
        raise UsageError(f"model.d_model ({d_model}) must be divisible by model.n_head ({n_head})")


def _check_data(d: DataConfig) -> None:
    if not d.source.strip():
        raise UsageError("data source must not be empty")
    if not 0 < d.val_fraction < 1:
        raise UsageError(f"data.val_fraction must be between 0 and 1, got {d.val_fraction}")


def _check_optim(o: OptimConfig) -> None:
    _positive("lr", o.lr)
    _non_negative("weight_decay", o.weight_decay)
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        if not 0 <= value < 1:
            raise UsageError(f"optim.{name} must be in [0, 1), got {value}")
    _positive("optim.eps", o.eps)
    _non_negative("warmup_steps", o.warmup_steps)
    if o.schedule not in SCHEDULES:
        raise UsageError(f"unknown lr schedule '{o.schedule}' (choose from: {', '.join(SCHEDULES)})")
    if not 0 <= o.min_lr_ratio <= 1:
        raise UsageError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")

"""Run configuration: dataclasses, TOML loading, CLI overrides and validation.

Every value a user can set lives here with its type and its check, so the CLI,
the TOML file and the Python API all reject the same bad values with the same
one-line message.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import UsageError

MODEL_PRESETS = {
    # name: (n_layer, n_head, d_model); parameter counts are for vocab 256, seq_len 128
    "tiny": (4, 4, 144),    # ~1.0M parameters
    "small": (6, 6, 384),   # ~10.7M parameters
    "medium": (8, 8, 512),  # ~25M parameters
}
SCHEDULES = ("cosine", "constant")
PARAM_DTYPES = ("fp32", "bf16")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layer: int = 0  # 0 = take it from the preset
    n_head: int = 0
    d_model: int = 0
    seq_len: int = 128

    def dims(self) -> tuple[int, int, int]:
        n_layer, n_head, d_model = MODEL_PRESETS[self.preset]
        return (self.n_layer or n_layer, self.n_head or n_head, self.d_model or d_model)


@dataclass
class DataConfig:
    source: str = "shakespeare"  # "shakespeare", "pydoc", or a text file / directory
    val_fraction: float = 0.1


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio


@dataclass
class AccoConfig:
    deterministic: bool = False  # exactly `accum` micro-batches per round, whatever the timing
    max_accum: int = 0           # cap on micro-batches per round while communication runs; 0 = 4 * accum


@dataclass
class DpuConfig:
    warmup_steps: int = 10  # synchronous steps before updates become delayed


@dataclass
class LinkConfig:
    """An emulated network link per rank (comm/link.py). No bandwidth = no emulation."""
    bandwidth: str = ""  # e.g. "100mbit", "1gbit", "12.5MB/s", "inf"
    latency: str = "0"   # per hop, e.g. "20ms", "500us"
    jitter: str = "0"    # each op's time varies uniformly by up to this much (seeded)


@dataclass
class RunConfig:
    strategy: str = "ddp"
    workers: int = 2
    steps: int = 200
    micro_batch: int = 16
    accum: int = 1
    seed: int = 0
    out: str = ""  # "" = runs/<strategy>-w<workers>-<timestamp>
    eval_every: int = 50
    eval_batches: int = 8
    threads: int = 1
    backend: str = "auto"
    device: str = "auto"  # auto: cuda with nccl, else cpu; cuda with gloo moves CUDA tensors over gloo
    bucket_mb: float = 25.0  # DDP gradient bucket size
    param_dtype: str = "fp32"  # flat parameter/gradient buffers of zero1, acco, dpu
    log_every: int = 5  # gather every rank's step results (a sync point) every K steps
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    acco: AccoConfig = field(default_factory=AccoConfig)
    dpu: DpuConfig = field(default_factory=DpuConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    slowdown: str = ""    # "f1,...,fW": rank r computes f_r times slower ("" = all 1)
    stragglers: str = ""  # "P,F": each step, with probability P one random rank is F times slower
    trace: bool = False   # write a Chrome/Perfetto trace.json of every rank

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.accum * self.micro_batch * self.model.seq_len


# --- setting values -------------------------------------------------------

def _section_and_field(cfg: RunConfig, key: str):
    """'optim.lr' -> (cfg.optim, Field lr). Raises UsageError for unknown keys."""
    obj: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        by_name = {f.name: f for f in fields(obj)}
        if part not in by_name:
            raise UsageError(f"unknown config key '{key}'")
        f = by_name[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise UsageError(f"config key '{key}' is a table, not a value")
            return obj, f
        obj = getattr(obj, part)
        if not dataclasses.is_dataclass(obj):
            raise UsageError(f"unknown config key '{key}'")
    raise UsageError(f"unknown config key '{key}'")


def _convert(raw: Any, typ: str, name: str) -> Any:
    if typ == "bool":
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"{name} must be true or false, got {str(raw)!r}")
    if typ == "int":
        if isinstance(raw, bool):
            raise UsageError(f"{name} must be an integer, got {raw!r}")
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        try:
            return int(str(raw).strip())
        except ValueError:
            raise UsageError(f"{name} must be an integer, got {str(raw)!r}") from None
    if typ == "float":
        if isinstance(raw, bool):
            raise UsageError(f"{name} must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a number, got {str(raw)!r}") from None
        if not math.isfinite(value):
            raise UsageError(f"{name} must be a finite number, got {str(raw)!r}")
        return value
    if typ == "str":
        if not isinstance(raw, str):
            raise UsageError(f"{name} must be a string, got {raw!r}")
        return raw
    raise AssertionError(typ)


def set_value(cfg: RunConfig, key: str, raw: Any, name: str | None = None) -> None:
    """Set dotted `key` from a raw value (CLI string or TOML value).
    `name` is how the user wrote it (e.g. '--lr'), for the error message."""
    obj, f = _section_and_field(cfg, key)
    setattr(obj, f.name, _convert(raw, str(f.type), name or key))


def load_toml(path: str | Path, cfg: RunConfig | None = None) -> RunConfig:
    cfg = cfg or RunConfig()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"config file '{path}' does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"config file '{path}' cannot be read: {e.__class__.__name__}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"config file '{path}' is not valid TOML: {e}") from None

    def walk(table: dict, prefix: str) -> None:
        for k, v in table.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                target: Any = cfg
                for part in key.split("."):
                    if not dataclasses.is_dataclass(target) or part not in {f.name for f in fields(target)}:
                        raise UsageError(f"unknown config key '{key}' in {path}")
                    target = getattr(target, part)
                if not dataclasses.is_dataclass(target):
                    raise UsageError(f"config key '{key}' in {path} must be a value, not a table")
                walk(v, key + ".")
            else:
                try:
                    set_value(cfg, key, v)
                except UsageError as e:
                    raise UsageError(f"{e} (in {path})") from None

    walk(data, "")
    return cfg


def set_link(cfg: RunConfig, raw: str, name: str = "--link") -> None:
    """--link BANDWIDTH,LATENCY[,JITTER] -> the [link] table's three values."""
    from .comm.link import split_link_spec
    cfg.link.bandwidth, cfg.link.latency, cfg.link.jitter = split_link_spec(raw, name)


def slowdown_factors(cfg: RunConfig) -> list[float]:
    """Each rank's slowdown factor (all 1.0 when none is set)."""
    if not cfg.slowdown.strip():
        return [1.0] * cfg.workers
    factors = []
    for part in cfg.slowdown.split(","):
        try:
            f = float(part)
        except ValueError:
            raise UsageError(f"slowdown factor '{part.strip()}' in '{cfg.slowdown}' is not a number") from None
        if not (math.isfinite(f) and f >= 1):
            raise UsageError(f"slowdown factor '{part.strip()}' in '{cfg.slowdown}' must be at least 1 "
                             f"(1 = full speed, 2 = twice as slow)")
        factors.append(f)
    if len(factors) != cfg.workers:
        raise UsageError(f"slowdown '{cfg.slowdown}' has {len(factors)} factor(s) but there are "
                         f"{cfg.workers} workers (give one per worker)")
    return factors


def straggler_settings(cfg: RunConfig) -> tuple[float, float]:
    """(P, F) from 'P,F'; (0, 1) when none is set."""
    if not cfg.stragglers.strip():
        return 0.0, 1.0
    try:
        p, f = (float(x) for x in cfg.stragglers.split(","))
    except ValueError:
        raise UsageError(f"stragglers '{cfg.stragglers}' must be P,F (e.g. 0.1,3)") from None
    if not 0 <= p <= 1:
        raise UsageError(f"stragglers probability '{p}' in '{cfg.stragglers}' must be in [0, 1]")
    if not (math.isfinite(f) and f >= 1):
        raise UsageError(f"stragglers factor '{f}' in '{cfg.stragglers}' must be at least 1")
    return p, f


def make_link(cfg: RunConfig, seed: int = 0):
    """The configured comm.link.LinkModel, or None for no emulation."""
    from .comm.link import LinkModel
    ln = cfg.link
    if not ln.bandwidth.strip():
        for key in ("latency", "jitter"):
            value = getattr(ln, key).strip()
            if value not in ("", "0"):
                raise UsageError(f"link.{key} '{value}' needs a link bandwidth too "
                                 f"(e.g. --link inf,{value} for latency only)")
        return None
    return LinkModel.parse(ln.bandwidth, ln.latency, ln.jitter, seed=seed)


# --- validation -------------------------------------------------------------

def validate(cfg: RunConfig, strategies: list[str] | None = None) -> None:
    """Check every value; raise UsageError naming the first bad one."""

    def positive(name: str, value: float) -> None:
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")

    def non_negative(name: str, value: float) -> None:
        if value < 0:
            raise UsageError(f"{name} must not be negative, got {value}")

    if strategies is not None and cfg.strategy not in strategies:
        raise UsageError(
            f"unknown strategy '{cfg.strategy}' (choose from: {', '.join(sorted(strategies))})")
    if cfg.workers < 1:
        raise UsageError(f"workers must be at least 1, got {cfg.workers}")
    positive("steps", cfg.steps)
    positive("micro_batch", cfg.micro_batch)
    positive("accum", cfg.accum)
    non_negative("seed", cfg.seed)
    non_negative("eval_every", cfg.eval_every)
    positive("eval_batches", cfg.eval_batches)
    positive("threads", cfg.threads)
    positive("bucket_mb", cfg.bucket_mb)
    positive("log_every", cfg.log_every)
    non_negative("acco.max_accum", cfg.acco.max_accum)
    non_negative("dpu.warmup_steps", cfg.dpu.warmup_steps)
    if cfg.param_dtype not in PARAM_DTYPES:
        raise UsageError(f"unknown param_dtype '{cfg.param_dtype}' (choose from: {', '.join(PARAM_DTYPES)})")
    if cfg.param_dtype != "fp32" and cfg.strategy == "ddp":
        raise UsageError(f"param_dtype '{cfg.param_dtype}' needs a sharded strategy (zero1, acco, dpu); ddp trains in fp32")
    make_link(cfg)
    slowdown_factors(cfg)
    straggler_settings(cfg)
    if cfg.backend not in BACKENDS:
        raise UsageError(f"unknown backend '{cfg.backend}' (choose from: {', '.join(BACKENDS)})")
    if cfg.device not in DEVICES:
        raise UsageError(f"unknown device '{cfg.device}' (choose from: {', '.join(DEVICES)})")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise UsageError("backend 'nccl' needs device 'cuda', got device 'cpu'")

    m = cfg.model
    if m.preset not in MODEL_PRESETS:
        raise UsageError(
            f"unknown model preset '{m.preset}' (choose from: {', '.join(MODEL_PRESETS)})")
    for name in ("n_layer", "n_head", "d_model"):
        non_negative(f"model.{name}", getattr(m, name))
    positive("seq_len", m.seq_len)
    n_layer, n_head, d_model = m.dims()
    if d_model % n_head:
        raise UsageError(f"model.d_model ({d_model}) must be divisible by model.n_head ({n_head})")

    d = cfg.data
    if not d.source.strip():
        raise UsageError("data source must not be empty")
    if not 0 < d.val_fraction < 1:
        raise UsageError(f"data.val_fraction must be between 0 and 1, got {d.val_fraction}")

    o = cfg.optim
    positive("lr", o.lr)
    non_negative("weight_decay", o.weight_decay)
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        if not 0 <= value < 1:
            raise UsageError(f"optim.{name} must be in [0, 1), got {value}")
    positive("optim.eps", o.eps)
    non_negative("warmup_steps", o.warmup_steps)
    if o.schedule not in SCHEDULES:
        raise UsageError(f"unknown lr schedule '{o.schedule}' (choose from: {', '.join(SCHEDULES)})")
    if not 0 <= o.min_lr_ratio <= 1:
        raise UsageError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")


# --- writing ------------------------------------------------------------------

def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML that `--config` reads back unchanged."""
    top, tables = [], []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            lines = [f"[{f.name}]"] + [f"{g.name} = {_toml_value(getattr(v, g.name))}" for g in fields(v)]
            tables.append("\n".join(lines))
        else:
            top.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"


def to_dict(cfg: RunConfig) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> RunConfig:
    cfg = RunConfig()
    for k, v in d.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                set_value(cfg, f"{k}.{k2}", v2)
        else:
            set_value(cfg, k, v)
    return cfg

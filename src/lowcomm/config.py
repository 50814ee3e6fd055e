"""Run configuration: dataclasses, TOML loading, CLI overrides and validation.

Every run-level value a user can set lives here with its type and its check,
so the CLI, the TOML file and the Python API all reject the same bad values
with the same one-line message. Strategy options are not listed here: each
strategy declares its own (strategies/options.py), and the registry supplies
their TOML tables (`[<strategy>]`), flags and checks. Composite values (`--link`,
`--slowdown`, `--stragglers`) are parsed into typed values when they are set.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .comm.link import format_bandwidth, format_duration, parse_bandwidth, parse_duration, split_link_spec
from .errors import UsageError
from .strategies import registry
from .strategies.inside import check_replicas
from .strategies.options import Options, type_name
from .values import convert, format_numbers, parse_slowdown, parse_stragglers

MODEL_PRESETS = {
    # name: (n_layer, n_head, d_model); parameter counts are for vocab 256, seq_len 128
    "tiny": (4, 4, 144),    # ~1.0M parameters
    "small": (6, 6, 384),   # ~10.7M parameters
    "medium": (8, 8, 512),  # ~25M parameters
}
HF_PREFIX = "hf:"  # --model hf:<architecture>: a transformers causal LM built from its config
SCHEDULES = ("cosine", "constant")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
MAX_TIMEOUT_S = 365 * 24 * 3600.0


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layer: int = 0  # 0 = take it from the preset
    n_head: int = 0
    d_model: int = 0
    seq_len: int = 128

    @property
    def hf_architecture(self) -> str | None:
        """'gpt2' for preset 'hf:gpt2'; None for lowcomm's own GPT."""
        return self.preset[len(HF_PREFIX):] if self.preset.startswith(HF_PREFIX) else None

    def dims(self) -> tuple[int, int, int]:
        """(n_layer, n_head, d_model); a Hugging Face model takes the tiny preset's unless given."""
        n_layer, n_head, d_model = MODEL_PRESETS["tiny" if self.hf_architecture else self.preset]
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


def _typed(parse, show):
    """Field metadata: how a raw value (CLI string or TOML value) is parsed, and written back."""
    return {"parse": parse, "show": show}


@dataclass
class LinkConfig:
    """An emulated network link per rank (comm/link.py), parsed when set. No bandwidth = no emulation."""
    bandwidth: float | None = field(default=None, metadata=_typed(  # bytes/s; e.g. "100mbit", "inf"
        lambda raw, name: parse_bandwidth(raw, name) if str(raw).strip() else None, format_bandwidth))
    latency: float = field(default=0.0, metadata=_typed(  # seconds per hop, e.g. "20ms"
        lambda raw, name: parse_duration(raw, name), format_duration))
    jitter: float = field(default=0.0, metadata=_typed(  # each op varies uniformly by up to this much
        lambda raw, name: parse_duration(raw, name), format_duration))


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
    log_every: int = 5  # gather every rank's step results (a sync point) every K steps
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    link: LinkConfig = field(default_factory=LinkConfig)  # across replicas (a flat run: between all workers)
    # R replicas of workers/R processes (0: one per worker), `inside` in each over `intra_link` (strategies/inside.py)
    replicas: int = 0
    inside: str = "ddp"
    intra_link: LinkConfig = field(default_factory=LinkConfig)
    # "f1,...,fW": rank r computes f_r times slower (empty = all 1)
    slowdown: tuple = field(default=(), metadata=_typed(parse_slowdown, format_numbers))
    # "P,F": each step, with probability P one random rank is F times slower
    stragglers: tuple | None = field(default=None, metadata=_typed(parse_stragglers, format_numbers))
    trace: bool = False   # write a Chrome/Perfetto trace.json of every rank
    timeout: float = 600.0  # seconds a collective may wait for a peer before the run fails
    checkpoint_on_signal: bool = False  # SIGINT/SIGTERM: write a checkpoint, then stop
    # Checkpoints and resume (checkpoint.py): every N steps and at the end (0: off), the last
    # `keep` kept; stop cleanly after step `stop_at` with a checkpoint (0: run to `steps`).
    checkpoint_every: int = 0
    keep: int = 2
    stop_at: int = 0
    max_restarts: int = 0   # relaunch every worker from the last good checkpoint after a failure
    max_bad_steps: int = 5  # consecutive skipped (non-finite) steps before the run stops
    # Strategy options by strategy name ([<strategy>] <option> = value), filled from the registry's
    # Options classes; `pending_options` holds values given before the strategy was known
    # (CLI flags, top-level TOML keys) until validate() applies them to the chosen one.
    options: dict = field(default_factory=dict, metadata={"internal": True})
    pending_options: dict = field(default_factory=dict, metadata={"internal": True})
    # The checkpoint directory this run continues from (set by the launcher: --resume, a restart).
    resume_from: str = field(default="", metadata={"internal": True})

    def strategy_options(self, name: str | None = None) -> Options:
        """The (chosen) strategy's options, its defaults where nothing was set."""
        name = name or self.strategy
        if name not in self.options:
            self.options[name] = registry.get(name).Options()
        return self.options[name]

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.accum * self.micro_batch * self.model.seq_len


# --- setting values -------------------------------------------------------

def _section_and_field(cfg: RunConfig, key: str):
    """'optim.lr' -> (cfg.optim, Field lr). Raises UsageError for unknown keys."""
    obj: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        by_name = {f.name: f for f in fields(obj) if not f.metadata.get("internal")}
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


def _is_strategy_table(name: str) -> bool:
    return name in registry.available()


def _option_field(options: Options, key: str, strategy: str):
    by_name = {f.name: f for f in fields(options)}
    if key not in by_name:
        known = ", ".join(by_name) or "none"
        raise UsageError(f"unknown config key '{strategy}.{key}' (options of {strategy}: {known})")
    return by_name[key]


def set_value(cfg: RunConfig, key: str, raw: Any, name: str | None = None) -> None:
    """Set dotted `key` from a raw value (CLI string or TOML value).
    `name` is how the user wrote it (e.g. '--lr'), for the error message.
    '<strategy>.<option>' sets a strategy option; a bare strategy option name
    ('max_accum', or 'param_dtype' as older configs wrote it) waits in
    pending_options until the strategy is known."""
    head, _, rest = key.partition(".")
    if rest and _is_strategy_table(head):
        options = cfg.strategy_options(head)
        f = _option_field(options, rest, head)
        setattr(options, f.name, convert(raw, type_name(f), name or key))
        return
    if not rest and key not in {f.name for f in fields(cfg)} and key in _all_option_fields():
        set_option(cfg, key, raw, name or key)
        return
    obj, f = _section_and_field(cfg, key)
    parse = f.metadata.get("parse")
    setattr(obj, f.name, parse(raw, name or key) if parse else convert(raw, type_name(f), name or key))


def set_option(cfg: RunConfig, field_name: str, raw: Any, name: str) -> None:
    """A strategy option given without its table (a CLI flag): applied to the chosen
    strategy by validate(), once the strategy is known."""
    cfg.pending_options[field_name] = (raw, name)


def _all_option_fields() -> dict[str, list[str]]:
    """option field name -> the strategies that declare it."""
    owners: dict[str, list[str]] = {}
    for name in registry.available():
        for f in fields(registry.get(name).Options):
            owners.setdefault(f.name, []).append(name)
    return owners


def resolve_options(cfg: RunConfig) -> Options:
    """Apply pending options to the chosen strategy and check all of its options."""
    options = cfg.strategy_options()
    for key, (raw, name) in cfg.pending_options.items():
        by_name = {f.name: f for f in fields(options)}
        if key not in by_name:
            owners = ", ".join(_all_option_fields().get(key, [])) or "none"
            raise UsageError(f"{name} does not apply to strategy '{cfg.strategy}' (it is an option of: {owners})")
        setattr(options, key, convert(raw, type_name(by_name[key]), name))
    cfg.pending_options.clear()
    for strategy, opts in cfg.options.items():
        opts.validate(strategy)
    other = next((name for name in cfg.options if name != cfg.strategy), None)
    if other is not None:  # as a flag of another strategy is refused, so is its table
        raise UsageError(f"[{other}] ({', '.join(f'{other}.{k}' for k in cfg.options[other].as_dict()) or 'a table'}) "
                         f"does not apply to strategy '{cfg.strategy}' (drop the table, or set strategy = \"{other}\")")
    options.check_run(cfg)
    return options


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
                if not prefix and _is_strategy_table(k):
                    walk(v, key + ".")
                    continue
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


def set_link(cfg: RunConfig, raw: str, name: str = "--link", table: str = "link") -> None:
    """--link BANDWIDTH,LATENCY[,JITTER] -> the [link] table's three typed values (--intra-link: [intra_link])."""
    bandwidth, latency, jitter = split_link_spec(raw, name)
    for key, value in (("bandwidth", bandwidth), ("latency", latency), ("jitter", jitter)):
        set_value(cfg, f"{table}.{key}", value, f"{table.replace('_', ' ')} {key}")


def make_link(cfg: RunConfig, seed: int = 0, table: str = "link"):
    """The configured comm.link.LinkModel ([link], or [intra_link]), or None for no emulation."""
    from .comm.link import LinkModel
    ln = getattr(cfg, table)
    if ln.bandwidth is None:
        return None
    return LinkModel(ln.bandwidth, ln.latency, ln.jitter, seed=seed)


# --- validation -------------------------------------------------------------

def validate(cfg: RunConfig, strategies: list[str] | None = None) -> None:
    """Check every value; raise UsageError naming the first bad one."""

    def positive(name: str, value: float) -> None:
        if value <= 0:
            raise UsageError(f"{name} must be positive, got {value}")

    def non_negative(name: str, value: float) -> None:
        if value < 0:
            raise UsageError(f"{name} must not be negative, got {value}")

    strategies = registry.available() if strategies is None else strategies
    if cfg.strategy not in strategies:
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
    positive("log_every", cfg.log_every)
    for name in ("checkpoint_every", "stop_at", "max_restarts"):
        non_negative(name, getattr(cfg, name))
    positive("keep", cfg.keep)
    positive("max_bad_steps", cfg.max_bad_steps)
    positive("timeout", cfg.timeout)
    if cfg.timeout > MAX_TIMEOUT_S:  # beyond what a timedelta (and gloo's milliseconds) can hold
        raise UsageError(f"timeout must be at most {MAX_TIMEOUT_S:.0f} seconds (a year), got {cfg.timeout:g}")
    resolve_options(cfg)
    name, options = registry.resolve(cfg.strategy, cfg.strategy_options())
    if name != cfg.strategy:  # an older spelling (quantized --bits 1): the run is named what runs
        cfg.options.pop(cfg.strategy)  # and its table is the new name's (no other strategy's is left)
        cfg.strategy, cfg.options[name] = name, options
        options.check_run(cfg)
    for table in ("link", "intra_link"):
        for key in ("latency", "jitter") if getattr(cfg, table).bandwidth is None else ():
            value = getattr(getattr(cfg, table), key)
            if value:
                raise UsageError(f"{table}.{key} '{format_duration(value)}' needs a link bandwidth too "
                                 f"(e.g. --{table.replace('_', '-')} inf,{format_duration(value)} for latency only)")
    check_replicas(cfg, [n for n in strategies if registry.get(n).runs_inside(cfg.inside)])
    if cfg.slowdown and len(cfg.slowdown) != cfg.workers:
        raise UsageError(f"slowdown '{format_numbers(cfg.slowdown)}' has {len(cfg.slowdown)} factor(s) but "
                         f"there are {cfg.workers} workers (give one per worker)")
    if cfg.backend not in BACKENDS:
        raise UsageError(f"unknown backend '{cfg.backend}' (choose from: {', '.join(BACKENDS)})")
    if cfg.device not in DEVICES:
        raise UsageError(f"unknown device '{cfg.device}' (choose from: {', '.join(DEVICES)})")
    if cfg.backend == "nccl" and cfg.device == "cpu":
        raise UsageError("backend 'nccl' needs device 'cuda', got device 'cpu'")

    m = cfg.model
    if m.hf_architecture is not None:
        if not m.hf_architecture:
            raise UsageError(f"model '{m.preset}' names no architecture (e.g. hf:gpt2, hf:llama)")
    elif m.preset not in MODEL_PRESETS:
        raise UsageError(
            f"unknown model preset '{m.preset}' (choose from: {', '.join(MODEL_PRESETS)}, or hf:<architecture>)")
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

def _shown(obj) -> dict:
    """A config dataclass as TOML-ready values (typed values written back as text)."""
    out = {}
    for f in fields(obj):
        if f.metadata.get("internal"):
            continue
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = _shown(v)
        elif "show" in f.metadata:
            out[f.name] = f.metadata["show"](v) if v not in (None, ()) else ""
        else:
            out[f.name] = v
    return out


def to_dict(cfg: RunConfig) -> dict:
    """The resolved config as the nested dict its config.toml reads back to:
    run settings, tables, and the chosen strategy's options as `[<strategy>]`."""
    d = _shown(cfg)
    options = cfg.strategy_options() if cfg.strategy in registry.available() else None
    if options is not None and fields(options):
        d[cfg.strategy] = options.as_dict()
    return d


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
    for key, v in to_dict(cfg).items():
        if isinstance(v, dict):
            tables.append("\n".join([f"[{key}]"] + [f"{k} = {_toml_value(x)}" for k, x in v.items()]))
        else:
            top.append(f"{key} = {_toml_value(v)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(tables) + "\n"


def from_dict(d: dict) -> RunConfig:
    cfg = RunConfig()
    for k, v in d.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                set_value(cfg, f"{k}.{k2}", v2)
        else:
            set_value(cfg, k, v)
    return cfg

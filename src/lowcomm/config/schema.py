"""The run configuration's shape: its dataclasses, their defaults, and the fixed choices.

Composite values (`--link`, `--slowdown`, `--stragglers`) carry field metadata saying how a
raw value is parsed and written back, so setting.py and tomlio.py treat them like any other.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..comm.link import format_bandwidth, format_duration, parse_bandwidth, parse_duration
from ..strategies import registry
from ..contract.options import Options
from ..contract.values import format_numbers, parse_slowdown, parse_stragglers

MODEL_PRESETS = {
    # name: (n_layer, n_head, d_model); parameter counts are for vocab 256, seq_len 128
    "tiny": (4, 4, 144),    # ~1.0M parameters
    "small": (6, 6, 384),   # ~10.7M parameters
    "medium": (8, 8, 512),  # ~25M parameters
    "gpt2": (12, 12, 768),  # GPT-2 small: ~124M parameters at its vocabulary (50257) and context (1024)
}
# Positions a preset's GPT is built with, where not --seq-len's (the others: exactly --seq-len,
# so their θ0 stays what it always was); --seq-len may not exceed it.
PRESET_CONTEXT = {"gpt2": 1024}
HF_PREFIX = "hf:"  # --model hf:<architecture>: a transformers causal LM built from its config
SCHEDULES = ("cosine", "constant")
PRECISIONS = ("fp32", "bf16", "fp16")  # --precision: forward and backward under autocast (fp32: none)
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
    init_from: str = ""  # start from these weights ("": random init from the seed); sets the dims (checks.py)
    compile: bool = False  # torch.compile the model
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    @property
    def hf_architecture(self) -> str | None:
        """'gpt2' for preset 'hf:gpt2'; None for lowcomm's own GPT."""
        return self.preset[len(HF_PREFIX):] if self.preset.startswith(HF_PREFIX) else None

    @property
    def context(self) -> int:
        """Positions lowcomm's GPT is built with (fresh, not --init-from: a saved model has its own)."""
        return PRESET_CONTEXT.get(self.preset, self.seq_len)

    def dims(self) -> tuple[int, int, int]:
        """(n_layer, n_head, d_model); a Hugging Face model takes the tiny preset's unless given."""
        n_layer, n_head, d_model = MODEL_PRESETS["tiny" if self.hf_architecture else self.preset]
        return (self.n_layer or n_layer, self.n_head or n_head, self.d_model or d_model)


@dataclass
class DataConfig:
    source: str = "shakespeare"  # "shakespeare", "pydoc", a text file / directory, or token files
    val_fraction: float = 0.1
    vocab_size: int = 0  # a token file's vocabulary where nothing beside it says (0: from the data)


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
    precision: str = "fp32"  # compute precision of forward and backward (PRECISIONS)
    log_every: int = 5  # gather every rank's step results (a sync point) every K steps
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    link: LinkConfig = field(default_factory=LinkConfig)  # across replicas (a flat run: between all workers)
    # R replicas of workers/R processes (0: one per worker), `inside` in each over `intra_link` (engines/inside.py)
    replicas: int = 0  # under torchrun across nodes, 0 means one replica per node (config/nodes.py)
    inside: str = "ddp"
    intra_link: LinkConfig = field(default_factory=LinkConfig)
    # "f1,...,fW": rank r computes f_r times slower (empty = all 1)
    slowdown: tuple = field(default=(), metadata=_typed(parse_slowdown, format_numbers))
    # "P,F": each step, with probability P one random rank is F times slower
    stragglers: tuple | None = field(default=None, metadata=_typed(parse_stragglers, format_numbers))
    trace: bool = False   # write a Chrome/Perfetto trace.json of every rank
    tensorboard: str = ""  # rank 0 logs each step's scalars to this directory ("" = off; metrics/tensorboard.py)
    wandb: str = ""  # rank 0 logs the same scalars to this W&B project ("" = off; metrics/wandb_log.py)
    timeout: float = 600.0  # seconds a collective may wait for a peer before the run fails
    checkpoint_on_signal: bool = False  # SIGINT/SIGTERM: write a checkpoint, then stop
    # Checkpoints and resume (checkpoint.py): every N steps and at the end (0: off), the last
    # `keep` kept; stop cleanly after step `stop_at` with a checkpoint (0: run to `steps`).
    checkpoint_every: int = 0
    keep: int = 2
    stop_at: int = 0
    max_restarts: int = 0   # relaunch every worker from the last good checkpoint after a failure
    max_bad_steps: int = 5  # consecutive skipped (non-finite) steps before the run stops
    # Elastic membership (lowcomm/elastic): a dead worker is dropped, the survivors go on, a
    # restarted one rejoins at a commit point; at least `min_workers` (0: all of them) train each step.
    elastic: bool = False
    min_workers: int = 0
    member_timeout: float = 0.0  # a member silent this long in a collective is dropped (0: elastic.support's default)
    quorum_timeout: float = 600.0  # members holding the run's state with no quorum this long: the run fails
    lighthouse: str = ""  # HOST:PORT of a running torchft lighthouse ("": the launcher starts one)
    # Strategy options by strategy name ([<strategy>] <option> = value), filled from the registry's
    # Options classes; `pending_options` holds values given before the strategy was known
    # (CLI flags, top-level TOML keys) until validate() applies them to the chosen one.
    options: dict = field(default_factory=dict, metadata={"internal": True})
    pending_options: dict = field(default_factory=dict, metadata={"internal": True})
    # The checkpoint directory this run continues from (set by the launcher: --resume, a restart).
    resume_from: str = field(default="", metadata={"internal": True})
    # Set when torchrun's nodes chose `replicas` (nodes.default_replicas): each replica must be a node.
    replicas_by_node: bool = field(default=False, metadata={"internal": True})
    # How the user wrote each setting given (config key -> '--max-restarts', or the TOML key): what a
    # refusal names, so it names the flag typed (setting.spelled).
    written_as: dict = field(default_factory=dict, compare=False, metadata={"internal": True})

    def strategy_options(self, name: str | None = None) -> Options:
        """The (chosen) strategy's options, its defaults where nothing was set."""
        name = name or self.strategy
        if name not in self.options:
            self.options[name] = registry.get(name).Options()
        return self.options[name]

    @property
    def local_workers(self) -> int:
        """Workers on this machine: torchrun's local world, else all of them."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.workers))

    @property
    def loader_micro_batch(self) -> int:
        """Sequences the loader gives one micro-batch: --micro-batch, cut in parts where the
        strategy computes a step's batch in parts (acco's two rounds)."""
        return self.micro_batch // registry.get(self.strategy).micro_batch_parts

    @property
    def end_step(self) -> int:
        """The step this part of the run ends at: --stop-at, else --steps."""
        return min(self.stop_at, self.steps) if self.stop_at else self.steps

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.accum * self.micro_batch * self.model.seq_len

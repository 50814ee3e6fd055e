"""The run flags (`lowcomm train`'s, shared with bench and plan): one table, their argparse
declarations, and reading them back into a RunConfig.

Values stay strings here: config.set_value converts and checks them, so a CLI value and
a TOML value fail with the same message. Each help line states its unit and its default,
the default read from RunConfig itself, so help and behaviour cannot drift apart.
This module imports nothing heavy at import time; building a parser does (config, and the
strategy registry for the option flags), which is why cli.py builds only the parser of
the subcommand being run.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Flag:
    key: str          # dotted config key
    metavar: str      # what the value is (its unit where it has one)
    help: str
    zero: str = ""    # how a 0/empty default reads (e.g. "off"), when it means something else
    switch: bool = False  # an on/off flag: given = true


RUN_FLAGS = {
    "--strategy": Flag("strategy", "NAME", "the strategy (one of: {strategies})"),
    "--workers": Flag("workers", "N", "worker processes W (under torchrun: the world size)"),
    "--replicas": Flag("replicas", "R", "R replicas of W/R processes each: the strategy runs across replicas, "
                                        "--inside within each",
                     zero="one per node under torchrun across nodes, else W: one process a replica"),
    "--inside": Flag("inside", "ENGINE", "what runs inside a replica: ddp (gradients averaged every step) or "
                                         "fsdp (FSDP2: parameters, gradients and optimizer state sharded; "
                                         "ddp and the diloco family)"),
    "--steps": Flag("steps", "N", "trainer steps: optimizer steps, or what the strategy counts as one "
                                  "(acco: rounds; diloco family: inner steps)"),
    "--micro-batch": Flag("micro_batch", "N", "sequences per micro-batch per worker"),
    "--accum": Flag("accum", "N", "micro-batches per step per worker (adaptive strategies: at least this many)"),
    "--seq-len": Flag("model.seq_len", "TOKENS", "tokens per sequence"),
    "--model": Flag("model.preset", "NAME", "model size preset ({presets}) or hf:<architecture>, a transformers "
                                            "causal LM built from its config (needs lowcomm[hf])"),
    "--n-layer": Flag("model.n_layer", "N", "transformer blocks", zero="the preset's"),
    "--n-head": Flag("model.n_head", "N", "attention heads", zero="the preset's"),
    "--d-model": Flag("model.d_model", "N", "model width (channels per token)", zero="the preset's"),
    "--lr": Flag("optim.lr", "LR", "peak learning rate (AdamW)"),
    "--warmup": Flag("optim.warmup_steps", "STEPS", "linear warmup, in trainer steps"),
    "--schedule": Flag("optim.schedule", "NAME", "lr schedule after warmup: cosine or constant"),
    "--min-lr-ratio": Flag("optim.min_lr_ratio", "FRACTION", "cosine floor as a fraction of --lr (0 to 1)"),
    "--weight-decay": Flag("optim.weight_decay", "COEF", "AdamW weight decay coefficient"),
    "--data": Flag("data.source", "SOURCE", "'shakespeare' (bundled), 'pydoc', or a UTF-8 text file or directory"),
    "--val-fraction": Flag("data.val_fraction", "FRACTION", "share of the text held out for validation (0 to 1)"),
    "--seed": Flag("seed", "N", "seed for init, data order and sampling"),
    "--out": Flag("out", "DIR", "output directory", zero="runs/<strategy>-w<W>-<time>"),
    "--eval-every": Flag("eval_every", "STEPS", "validate every STEPS trainer steps", zero="only at the end"),
    "--eval-batches": Flag("eval_batches", "N", "validation micro-batches per worker"),
    "--threads": Flag("threads", "N", "torch threads per worker"),
    "--backend": Flag("backend", "NAME", "auto (nccl with CUDA, else gloo), gloo or nccl"),
    "--device": Flag("device", "NAME", "auto (cuda with nccl, else cpu), cpu or cuda"),
    "--log-every": Flag("log_every", "STEPS", "gather all ranks' step results every STEPS trainer steps"),
    "--slowdown": Flag("slowdown", "F1,...,FW", "rank r computes F_r times slower, each factor >= 1 (emulated)",
                       zero="none"),
    "--stragglers": Flag("stragglers", "P,F", "each step one random rank is F times slower with probability P "
                                              "(emulated)", zero="none"),
    "--timeout": Flag("timeout", "SECONDS", "seconds a collective waits for a stuck peer before the run fails"),
    "--checkpoint-every": Flag("checkpoint_every", "STEPS", "write a checkpoint every STEPS trainer steps and at the "
                                                            "end", zero="off"),
    "--keep": Flag("keep", "N", "checkpoints kept (the newest N)"),
    "--stop-at": Flag("stop_at", "STEP", "end cleanly after this trainer step with a checkpoint (continue later "
                                         "with --resume)", zero="off"),
    "--max-restarts": Flag("max_restarts", "N", "relaunch all workers from the last good checkpoint up to N times",
                           zero="0: none"),
    "--elastic": Flag("elastic", "", "survivors go on when a worker dies; a restarted worker rejoins with the "
                                     "live state (ddp, zero1, diloco; needs torchft: pip install 'lowcomm[elastic]')",
                      switch=True),
    "--min-workers": Flag("min_workers", "N", "with --elastic: the fewest workers a step may run with",
                          zero="all of --workers"),
    "--member-timeout": Flag("member_timeout", "SECONDS", "with --elastic: a member that a collective waits on "
                                                          "this long (frozen, hung) is dropped", zero="10 s"),
    "--lighthouse": Flag("lighthouse", "HOST:PORT", "with --elastic: use this running torchft lighthouse (its "
                                                    "--min_replicas is the quorum) instead of starting one",
                         zero="the launcher starts one"),
    "--max-bad-steps": Flag("max_bad_steps", "N", "stop after this many consecutive non-finite (skipped) steps"),
    "--trace": Flag("trace", "", "write trace.json (Chrome/Perfetto) with every rank's spans", switch=True),
    "--tensorboard": Flag("tensorboard", "DIR", "log each step's scalars (loss, tokens/s, bytes, exposed share, "
                                                "per-rank compute) to DIR for TensorBoard; needs lowcomm[tensorboard]",
                          zero="off"),
    "--wandb": Flag("wandb", "PROJECT", "log the same scalars as --tensorboard to this Weights & Biases project "
                                        "(W&B's settings apply: wandb login, WANDB_MODE); needs lowcomm[wandb]",
                    zero="off"),
    "--checkpoint-on-signal": Flag("checkpoint_on_signal", "", "on SIGINT/SIGTERM write a checkpoint before "
                                                               "stopping", switch=True),
}
LINK_HELP = ("emulate a link per rank: bandwidth in bit/s (100mbit, 1gbit, inf) or bytes/s (50MB/s), latency "
             "(10ms), optional jitter (1ms); TOML: [link]")
TYPE_METAVARS = {"int": "N", "float": "NUM", "str": "TEXT"}


def dest(key: str) -> str:
    return key.replace(".", "__")


def option_dest(field: str) -> str:
    return f"option__{field}"


def shown(value, zero: str = "") -> str:
    """A default as help shows it: on/off for switches, `zero` for a 0 or empty that means something else."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if zero and value in (0, "", (), None):
        return zero
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def add_run_flags(parser: argparse.ArgumentParser, names: Iterable[str], helps: dict[str, str] | None = None) -> None:
    """Declare the named RUN_FLAGS, each help ending in its default (`helps` replaces a help's text)."""
    from . import config as C
    from .strategies import available

    defaults = C.RunConfig()
    fill = {"strategies": ", ".join(available()), "presets": ", ".join(C.MODEL_PRESETS)}
    for name in names:
        flag = RUN_FLAGS[name]
        text = (helps or {}).get(name, flag.help).format(**fill)
        if "(default" not in text:
            text += f" (default: {shown(functools.reduce(getattr, flag.key.split('.'), defaults), flag.zero)})"
        if flag.switch:
            parser.add_argument(name, dest=dest(flag.key), action="store_true", default=None, help=text)
        else:
            parser.add_argument(name, dest=dest(flag.key), metavar=flag.metavar, help=text)


def add_link_flag(parser: argparse.ArgumentParser, default: str = "none") -> None:
    parser.add_argument("--link", metavar="BW,LAT[,JIT]", help=f"{LINK_HELP} (default: {default})")


def add_intra_link_flag(parser: argparse.ArgumentParser, more: str = "") -> None:
    """--intra-link; `more`: what it also means to this subcommand, said before the default."""
    parser.add_argument("--intra-link", metavar="BW,LAT[,JIT]",
                        help=f"emulate the link inside a replica, as --link; TOML: [intra_link]{more} (default: none)")


def add_strategy_options(parser: argparse.ArgumentParser) -> None:
    """Every registered strategy's option flags (importing the strategies: torch)."""
    from .strategies import option_table

    group = parser.add_argument_group(
        "strategy options", "each applies to the strategies named before its help; TOML: [<strategy>] <name> = value")
    for flag, opt in option_table().items():
        differ = "".join(f"; {name}: {shown(d)}" for name, d in opt.defaults.items() if d != opt.default)
        text = f"{', '.join(opt.strategies)}: {opt.help} (default: {shown(opt.default)}{differ})"
        if opt.type == "bool":
            group.add_argument(flag, dest=option_dest(opt.field), action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            group.add_argument(flag, dest=option_dest(opt.field), metavar=TYPE_METAVARS.get(opt.type, "VALUE"),
                               help=text)


def given(args: argparse.Namespace, name: str) -> bool:
    """Whether the run flag `name` was given (False where the subcommand does not declare it)."""
    return getattr(args, dest(RUN_FLAGS[name].key), None) is not None


def config_from_args(args: argparse.Namespace):
    """The RunConfig the flags describe: --config's file (or the defaults), then the flags;
    with --resume, the run's own config and only the flags a resumed run may change."""
    from . import config as C

    if getattr(args, "resume", None):
        from .checkpoint import resume_config
        _refuse_for_resume(args)
        return resume_config(args, lambda cfg: apply_flags(cfg, args))
    config = getattr(args, "config", None)
    return apply_flags(C.load_toml(config) if config else C.RunConfig(), args)


def _refuse_for_resume(args: argparse.Namespace) -> None:
    """What a resumed run cannot honour, named before anything else is compared: a resumed
    run continues its own strategy in its own directory."""
    from pathlib import Path

    from . import config as C
    from .errors import UsageError

    if getattr(args, "overwrite", False):
        raise UsageError(f"--overwrite does not apply with --resume (it continues the run in {args.resume}; "
                         f"to start over, drop --resume)")
    saved = Path(args.resume) / "config.toml"
    if given(args, "--strategy") and saved.is_file():
        trained = C.load_toml(saved).strategy
        if args.strategy != trained:
            raise UsageError(f"--strategy {args.strategy}: the run in {args.resume} trains {trained}, and a resumed "
                             f"run keeps its strategy (start a new run for {args.strategy})")


def apply_flags(cfg, args: argparse.Namespace):
    """Set what the flags the subcommand declares say (a flag not given leaves cfg as it is)."""
    from . import config as C
    from .strategies import option_table

    for name, flag in RUN_FLAGS.items():
        raw = getattr(args, dest(flag.key), None)
        if raw is not None:
            C.set_value(cfg, flag.key, _not_empty(raw, name), name=name)
    if getattr(args, "link", None) is not None:
        C.set_link(cfg, _not_empty(args.link, "--link"))
    if getattr(args, "intra_link", None) is not None:
        C.set_link(cfg, _not_empty(args.intra_link, "--intra-link"), "--intra-link", "intra_link")
    for name, opt in option_table().items():
        raw = getattr(args, option_dest(opt.field), None)
        if raw is not None:
            C.set_option(cfg, opt.field, _not_empty(raw, name), name)
    return cfg


def _not_empty(raw, name: str):
    """An empty value ('--out ""', '--slowdown ""') is refused, not read as the default."""
    from .errors import UsageError

    if isinstance(raw, str) and not raw.strip():
        raise UsageError(f"{name} is given an empty value (leave the flag out for its default)")
    return raw


"""`lowcomm` command line. Thin: parse, build the config, hand over to launch."""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from . import config as C
from .errors import Interrupted, RunError, UsageError
from .strategies import available, option_table
from .subcommands import add_subcommands, run_subcommand

# flag -> dotted config key. Values stay strings here: config.set_value converts
# and checks them, so a CLI value and a TOML value fail with the same message.
TRAIN_FLAGS = {
    "--strategy": ("strategy", "the strategy (one of: {strategies})"),
    "--workers": ("workers", "number of worker processes W"),
    "--replicas": ("replicas", "R replicas of W/R processes each: the strategy runs across replicas (default W)"),
    "--inside": ("inside", "what runs inside a replica: ddp (gradients averaged every step); fsdp: not yet"),
    "--steps": ("steps", "trainer steps (an optimizer step, or what the strategy counts as one: see its docs)"),
    "--micro-batch": ("micro_batch", "sequences per micro-batch per worker"),
    "--accum": ("accum", "micro-batches accumulated per step (adaptive strategies: at least this many)"),
    "--seq-len": ("model.seq_len", "tokens per sequence"),
    "--model": ("model.preset", f"model size preset ({', '.join(C.MODEL_PRESETS)}) or hf:<architecture> "
                                "(a transformers causal LM built from its config; needs lowcomm[hf])"),
    "--n-layer": ("model.n_layer", "override the preset's layer count"),
    "--n-head": ("model.n_head", "override the preset's head count"),
    "--d-model": ("model.d_model", "override the preset's width"),
    "--lr": ("optim.lr", "peak learning rate"),
    "--warmup": ("optim.warmup_steps", "linear warmup steps"),
    "--schedule": ("optim.schedule", "lr schedule after warmup (cosine, constant)"),
    "--min-lr-ratio": ("optim.min_lr_ratio", "cosine floor as a fraction of --lr"),
    "--weight-decay": ("optim.weight_decay", "AdamW weight decay"),
    "--data": ("data.source", "'shakespeare' (bundled), 'pydoc', or a text file or directory"),
    "--val-fraction": ("data.val_fraction", "share of the text held out for validation"),
    "--seed": ("seed", "seed for init, data order and sampling"),
    "--out": ("out", "output directory (default runs/<strategy>-w<W>-<time>)"),
    "--eval-every": ("eval_every", "validate every K steps (0: only at the end)"),
    "--eval-batches": ("eval_batches", "validation micro-batches per worker"),
    "--threads": ("threads", "torch threads per worker"),
    "--backend": ("backend", "auto (nccl with CUDA, else gloo), gloo or nccl"),
    "--device": ("device", "auto (cuda with nccl, else cpu), cpu or cuda"),
    "--log-every": ("log_every", "gather all ranks' step results every K steps"),
    "--slowdown": ("slowdown", "f1,...,fW: rank r computes f_r times slower (emulated)"),
    "--stragglers": ("stragglers", "P,F: each step one random rank is F times slower with probability P"),
    "--timeout": ("timeout", "seconds a collective waits for a stuck peer before the run fails (default 600)"),
    "--checkpoint-every": ("checkpoint_every", "write a checkpoint every N steps and at the end (0: off)"),
    "--keep": ("keep", "checkpoints kept (the newest K; default 2)"),
    "--stop-at": ("stop_at", "end cleanly after step S with a checkpoint (resume later with --resume)"),
    "--max-restarts": ("max_restarts", "relaunch all workers from the last good checkpoint up to N times"),
    "--max-bad-steps": ("max_bad_steps", "stop after this many consecutive non-finite (skipped) steps (default 5)"),
}
# on/off flags -> dotted config key set to true
TRAIN_SWITCHES = {
    "--trace": ("trace", "write trace.json (Chrome/Perfetto) with every rank's spans"),
    "--checkpoint-on-signal": ("checkpoint_on_signal", "on SIGINT/SIGTERM write a checkpoint before stopping"),
}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --step is not --steps: flags match exactly
        super().__init__(*args, **kwargs)
        # argparse takes only plain negative numbers for values; '--link -100mbit,10ms' or
        # '--slowdown -2,1' would read as an unknown flag, so the value's check never named it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lowcomm", description="Communication-efficient data-parallel training.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    train = sub.add_parser("train", help="train a GPT data-parallel with one strategy",
                           description="Train a small GPT on W workers with a chosen strategy.")
    train.add_argument("--config", metavar="FILE", help="TOML file of settings (flags override it)")
    for flag, (key, help_text) in TRAIN_FLAGS.items():
        help_text = help_text.format(strategies=", ".join(available()))
        train.add_argument(flag, dest=key.replace(".", "__"), metavar="X", help=help_text)
    for flag, (key, help_text) in TRAIN_SWITCHES.items():
        train.add_argument(flag, dest=key.replace(".", "__"), action="store_true", default=None, help=help_text)
    options = train.add_argument_group(
        "strategy options", "each applies to the strategies named before its help; TOML: [<strategy>] <name> = value")
    for flag, opt in option_table().items():
        differ = "".join(f"; {name}: {_shown_default(d)}" for name, d in opt.defaults.items() if d != opt.default)
        help_text = f"{', '.join(opt.strategies)}: {opt.help} (default {_shown_default(opt.default)}{differ})"
        if opt.type == "bool":
            options.add_argument(flag, dest=_option_dest(opt.field), action=argparse.BooleanOptionalAction,
                                 default=None, help=help_text)
        else:
            options.add_argument(flag, dest=_option_dest(opt.field), metavar="X", help=help_text)
    train.add_argument("--link", metavar="BW,LAT[,JIT]",
                       help="emulate a link per rank, e.g. 100mbit,20ms or 1gbit,5ms,1ms (TOML: [link])")
    train.add_argument("--intra-link", metavar="BW,LAT[,JIT]",
                       help="emulate the link inside a replica (default: unshaped; TOML: [intra_link])")
    train.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest complete "
                       "checkpoint (its config.toml; --steps, --stop-at and other safe flags may change)")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    add_subcommands(sub, train)  # bench, report, plan (subcommands.py): bench and plan reuse train's flags
    return parser


def config_from_args(args: argparse.Namespace) -> C.RunConfig:
    if getattr(args, "resume", None):
        from .checkpoint import resume_config
        return resume_config(args, lambda cfg: _apply_flags(cfg, args))
    return _apply_flags(C.load_toml(args.config) if args.config else C.RunConfig(), args)


def _apply_flags(cfg: C.RunConfig, args: argparse.Namespace) -> C.RunConfig:
    for flag, (key, _) in {**TRAIN_FLAGS, **TRAIN_SWITCHES}.items():
        raw = getattr(args, key.replace(".", "__"))
        if raw is not None:
            C.set_value(cfg, key, raw, name=flag)
    if args.link is not None:
        C.set_link(cfg, args.link)
    if args.intra_link is not None:
        C.set_link(cfg, args.intra_link, "--intra-link", "intra_link")
    for flag, opt in option_table().items():
        raw = getattr(args, _option_dest(opt.field))
        if raw is not None:
            C.set_option(cfg, opt.field, raw, flag)
    return cfg


def _resuming(args: argparse.Namespace) -> bool:
    """--resume, or a worker torchrun restarted (--max-restarts): both continue from --out's checkpoint."""
    return bool(args.resume) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _option_dest(field: str) -> str:
    return f"option__{field}"


def _shown_default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    from .launch import launch, prepare, under_torchrun

    out = None
    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help(sys.stderr)
            return 2
        if args.command != "train":
            return run_subcommand(args)
        cfg = config_from_args(args)
        lead = not under_torchrun() or os.environ.get("RANK", "0") == "0"
        out = prepare(cfg, create=lead, overwrite=args.overwrite, resume=_resuming(args))
        launch(cfg, out, quiet=args.quiet)
        if lead:
            print(f"lowcomm: results in {out}", flush=True)
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        return _failed(str(e), e.details, out)
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a failure while training (e.g. a torchrun rank's): one line, traceback to a file
        if out is None:
            raise  # no run yet: a bug, shown in full
        return _failed(f"{type(e).__name__}: {e}", traceback.format_exc(), out)


def _failed(message: str, details: str, out) -> int:
    """One `error:` line on the terminal; the tracebacks go to the run directory's error.log."""
    message = " ".join(message.split())  # one line, whatever the exception's text holds
    if details and out is not None and out.is_dir():
        rank = os.environ.get("RANK", "0")
        log = out / ("error.log" if rank == "0" else f"error-rank{rank}.log")
        try:
            log.write_text(details if details.endswith("\n") else details + "\n")
            message += f" (traceback in {log})"
        except OSError:
            pass
    print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

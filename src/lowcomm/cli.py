"""`lowcomm` command line. Thin: parse, build the config, hand over to launch."""
from __future__ import annotations

import argparse
import os
import sys

from . import config as C
from .errors import RunError, UsageError
from .strategies import available, option_table

# flag -> dotted config key. Values stay strings here: config.set_value converts
# and checks them, so a CLI value and a TOML value fail with the same message.
TRAIN_FLAGS = {
    "--strategy": ("strategy", "the strategy (one of: {strategies})"),
    "--workers": ("workers", "number of worker processes W"),
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
}
# on/off flags -> dotted config key set to true
TRAIN_SWITCHES = {
    "--trace": ("trace", "write trace.json (Chrome/Perfetto) with every rank's spans"),
}


class _Parser(argparse.ArgumentParser):
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
        help_text = f"{', '.join(opt.strategies)}: {opt.help} (default {_shown_default(opt.default)})"
        if opt.type == "bool":
            options.add_argument(flag, dest=_option_dest(opt.field), action=argparse.BooleanOptionalAction,
                                 default=None, help=help_text)
        else:
            options.add_argument(flag, dest=_option_dest(opt.field), metavar="X", help=help_text)
    train.add_argument("--link", metavar="BW,LAT[,JIT]",
                       help="emulate a link per rank, e.g. 100mbit,20ms or 1gbit,5ms,1ms (TOML: [link])")
    train.add_argument("--overwrite", action="store_true", help="replace a run already in --out")
    train.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def config_from_args(args: argparse.Namespace) -> C.RunConfig:
    cfg = C.load_toml(args.config) if args.config else C.RunConfig()
    for flag, (key, _) in {**TRAIN_FLAGS, **TRAIN_SWITCHES}.items():
        raw = getattr(args, key.replace(".", "__"))
        if raw is not None:
            C.set_value(cfg, key, raw, name=flag)
    if args.link is not None:
        C.set_link(cfg, args.link)
    for flag, opt in option_table().items():
        raw = getattr(args, _option_dest(opt.field))
        if raw is not None:
            C.set_option(cfg, opt.field, raw, flag)
    return cfg


def _option_dest(field: str) -> str:
    return f"option__{field}"


def _shown_default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    from .launch import launch, prepare, under_torchrun

    try:
        args = build_parser().parse_args(argv)
        if args.command is None:
            build_parser().print_help(sys.stderr)
            return 2
        cfg = config_from_args(args)
        lead = not under_torchrun() or os.environ.get("RANK", "0") == "0"
        out = prepare(cfg, create=lead, overwrite=args.overwrite)
        launch(cfg, out, quiet=args.quiet)
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        head, _, rest = str(e).partition("\n")
        if rest:
            print(rest, file=sys.stderr)
        print(f"error: {head} {_last_line(rest)}".rstrip(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


if __name__ == "__main__":
    sys.exit(main())

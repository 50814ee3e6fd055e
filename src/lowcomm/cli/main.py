"""`lowcomm` command line. Thin: parse, build the config, hand over to launch or a subcommand.

Only the parser of the subcommand being run is filled in (`build_parser(only=...)`): its
flags' defaults come from RunConfig and its strategy options from the registry, both of
which import torch, and `lowcomm --help` or `--version` must answer at once.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback

from .. import __version__
from ..errors import Interrupted, RunError, UsageError
from ..config.flags import RUN_FLAGS
from .flags import add_intra_link_flag, add_link_flag, add_run_flags, add_strategy_options, config_from_args
from .verbs import SUBCOMMANDS, run_subcommand

__all__ = ["build_parser", "config_from_args", "main"]


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --step is not --steps: flags match exactly
        super().__init__(*args, **kwargs)
        # argparse takes only plain negative numbers for values; '--link -100mbit,10ms' or
        # '--slowdown -2,1' would read as an unknown flag, so the value's check never named it.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):  # one line, exit 2, no usage dump
        raise UsageError(_not_for_this_command(message, getattr(self, "command", None)))


def _not_for_this_command(message: str, command: str | None) -> str:
    """argparse's 'unrecognized arguments: --lr 0.1' for a flag another subcommand takes:
    '--lr does not apply to lowcomm plan'."""
    head = "unrecognized arguments: "
    if command and message.startswith(head):
        flag = message[len(head):].split()[0].split("=")[0]
        if flag in RUN_FLAGS or flag in OTHER_FLAGS:
            return f"{flag} does not apply to lowcomm {command} (`lowcomm {command} --help` lists its flags)"
    return message


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("--config", metavar="FILE", help="TOML file of settings; flags override it (default: none)")
    add_run_flags(train, RUN_FLAGS)
    add_link_flag(train)
    add_intra_link_flag(train)
    train.add_argument("--overwrite", action="store_true", help="replace a run already in --out (default: off)")
    train.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest complete "
                       "checkpoint with its config.toml; only --steps, --stop-at, checkpointing, logging, "
                       "evaluation and emulation flags may change (default: none)")
    train.add_argument("--quiet", action="store_true", help="no progress output (default: off)")
    add_strategy_options(train)


OTHER_FLAGS = {"--config", "--link", "--overwrite", "--resume", "--quiet", "--out", "--strategies", "--tokens",
               "--target-loss", "--params", "--worker-tflops", "--tokens-per-step", "--calibrate", "--json"}
COMMANDS = {  # name -> (one line for `lowcomm --help`, description, what declares its arguments)
    "train": ("train a GPT data-parallel with one strategy",
              "Train a small GPT on W workers with a chosen strategy; results in --out.", add_train_arguments),
    **SUBCOMMANDS,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `lowcomm` parser; with `only`, just that subcommand's arguments are declared."""
    parser = _Parser(prog="lowcomm", description="Communication-efficient data-parallel training: compare "
                     "strategies on emulated links (bench, plan), train with one (train).",
                     epilog="`lowcomm COMMAND --help` lists a command's flags. Start with: lowcomm bench")
    parser.command = only or None  # for the message about a flag of another subcommand
    parser.add_argument("--version", action="version", version=f"lowcomm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (summary, description, add_arguments) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=description,
                                 usage=f"lowcomm {name} [flags]" + {"report": " RUNDIR...", "bench": " [RECIPE.toml]", "join": " RUNDIR",
                                                                  "data": " prepare SOURCE", "sample": " RUNDIR"}.get(name, ""))
        if only is None or only == name:
            add_arguments(command)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the top level has no flag that takes a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    out = None
    try:
        command = _command(argv)
        parser = build_parser(only=command if command in COMMANDS else "")
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        if args.command != "train":
            return run_subcommand(args)
        from ..launch.launcher import launch, prepare, results_line, under_torchrun

        cfg = config_from_args(args)
        lead = not under_torchrun() or os.environ.get("RANK", "0") == "0"
        out = prepare(cfg, create=lead, overwrite=args.overwrite, resume=_resuming(args))
        records = launch(cfg, out, quiet=args.quiet)
        if lead:
            print(results_line(out, records), flush=True)
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


def _resuming(args: argparse.Namespace) -> bool:
    """--resume, or a worker torchrun restarted (--max-restarts): both continue from --out's checkpoint."""
    return bool(args.resume) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _failed(message: str, details: str, out) -> int:
    """One `error:` line on the terminal; the tracebacks go to the run directory's error.log."""
    message = " ".join(message.split())  # one line, whatever the exception's text holds
    if details and out is not None and out.is_dir():
        rank = os.environ.get("RANK", "0")
        log = out / ("error.log" if rank == "0" else f"error-rank{rank}.log")
        try:
            log.write_text(details if details.endswith("\n") else details + "\n")
            message += f" (traceback in {log})"
        except OSError:  # a full disk: no half-written log either
            log.unlink(missing_ok=True)
    print(f"error: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

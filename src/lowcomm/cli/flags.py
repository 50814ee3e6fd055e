"""The run flags declared to argparse (each help ending in its default, read from RunConfig
itself, so help and behaviour cannot drift apart) and read back into a RunConfig.

Values stay strings here: config.set_value converts and checks them, so a CLI value and
a TOML value fail with the same message. This module imports nothing heavy at import time;
building a parser does (config, and the strategy registry for the option flags), which is
why cli/main.py builds only the parser of the subcommand being run.
"""
from __future__ import annotations

import argparse
import functools
from typing import Iterable

from ..contract.values import convert
from ..errors import UsageError
from ..config.flags import LINK_FLAGS, LINK_HELP, RUN_FLAGS, TYPE_METAVARS, dest, given, option_dest, shown


def add_run_flags(parser: argparse.ArgumentParser, names: Iterable[str], helps: dict[str, str] | None = None) -> None:
    """Declare the named RUN_FLAGS, each help ending in its default (`helps` replaces a help's text)."""
    from .. import config as C

    defaults = C.RunConfig()
    fill = {**strategy_lists(), "presets": ", ".join(C.MODEL_PRESETS)}
    for name in names:
        flag = RUN_FLAGS[name]
        text = (helps or {}).get(name, flag.help).format(**fill)
        if "(default" not in text:
            text += f" (default: {shown(functools.reduce(getattr, flag.key.split('.'), defaults), flag.zero)})"
        if flag.switch:
            parser.add_argument(name, dest=dest(flag.key), action="store_true", default=None, help=text)
        else:
            parser.add_argument(name, dest=dest(flag.key), metavar=flag.metavar, help=text)


def strategy_lists() -> dict[str, str]:
    """The strategy lists the run flags' help names, read from the registry (a strategy's file
    says what it runs with, so the help follows it): all of them, those that run with FSDP inside
    a replica, those that run --elastic at their defaults."""
    from ..strategies import available, get

    names = available()

    def listed(which: list[str]) -> str:
        return "every strategy" if which == names else ", ".join(which) or "none yet"
    return {"strategies": ", ".join(names),
            "fsdp_strategies": listed([n for n in names if get(n).runs_inside("fsdp")]),
            "elastic_strategies": listed([n for n in names if not get(n).elastic.refusal(get(n).Options(), False)])}


def add_link_flag(parser: argparse.ArgumentParser, default: str = "none") -> None:
    parser.add_argument("--link", metavar="BW,LAT[,JIT]", help=f"{LINK_HELP} (default: {default})")


def add_intra_link_flag(parser: argparse.ArgumentParser, more: str = "") -> None:
    """--intra-link; `more`: what it also means to this subcommand, said before the default."""
    parser.add_argument("--intra-link", metavar="BW,LAT[,JIT]",
                        help=f"emulate the link inside a replica, as --link; TOML: [intra_link]{more} (default: none)")


def add_strategy_options(parser: argparse.ArgumentParser) -> None:
    """Every registered strategy's option flags (importing the strategies: torch)."""
    from ..strategies import option_table

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


def flag_table(train: argparse.ArgumentParser) -> str:
    """`lowcomm train`'s flags as docs/cli.md's table (flag, TOML key, default, meaning), read from
    its parser (`train`), so the page says what --help says: a strategy's options are left to
    docs/strategies.md, a flag with no TOML form has an empty key."""
    options = {a for group in train._action_groups if group.title == "strategy options" for a in group._group_actions}
    rows = ["| flag | TOML key | default | meaning |", "|---|---|---|---|"]
    for action in train._actions:
        if action in options or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0]
        meaning, _, default = action.help.rpartition(" (default: ")
        key = RUN_FLAGS[name].key if name in RUN_FLAGS else LINK_FLAGS.get(name)
        toml = f"`{key}`" + (f" or `[{key}]`" if name in LINK_FLAGS else "") if key else ""
        flag = f"`{name} {action.metavar}`" if action.metavar else f"`{name}`"
        rows.append(" | ".join(["", flag, toml, _shown_default(default[:-1]), _markdown(meaning), ""]).strip())
    return "\n".join(rows) + "\n"


def _shown_default(default: str) -> str:
    """A value (`ddp`, `runs/<strategy>-w<W>-<time>`) as code; words ('the preset's') as words."""
    return _markdown(default) if " " in default else f"`{default}`"


def _markdown(text: str) -> str:
    """Help text in a table cell: a '|' would end the cell, a '<name>' would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<")


def config_from_args(args: argparse.Namespace):
    """The RunConfig the flags describe: --config's file (or the defaults), then the flags;
    with --resume, the run's own config and only the flags a resumed run may change."""
    from .. import config as C

    if getattr(args, "resume", None):
        from ..checkpoint import resume_config
        _refuse_for_resume(args)
        return resume_config(args, lambda cfg: apply_flags(cfg, args))
    config = getattr(args, "config", None)
    return apply_flags(C.load_toml(config) if config else C.RunConfig(), args)


def _refuse_for_resume(args: argparse.Namespace) -> None:
    """What a resumed run cannot honour, named before anything else is compared: a resumed
    run continues its own strategy in its own directory."""
    from pathlib import Path

    from .. import config as C
    from ..errors import UsageError

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
    from .. import config as C
    from ..strategies import option_table

    for name, flag in RUN_FLAGS.items():
        raw = getattr(args, dest(flag.key), None)
        if raw is not None:
            C.set_value(cfg, flag.key, _not_empty(raw, name), name=name)
    if getattr(args, "link", None) is not None:
        C.set_link(cfg, _not_empty(args.link, "--link"))
    if getattr(args, "intra_link", None) is not None:
        C.set_link(cfg, _not_empty(args.intra_link, "--intra-link"), "--intra-link", "intra_link")
    given = {}
    for name, opt in option_table().items():
        raw = getattr(args, option_dest(opt.field), None)
        if raw is not None:
            C.set_option(cfg, opt.field, _not_empty(raw, name), name)
            given[opt.field] = raw
    if cfg.elastic:
        from ..elastic.support import refuse_overridden
        refuse_overridden(cfg, given)
    return cfg


def _not_empty(raw, name: str):
    """An empty value ('--out ""', '--slowdown ""') is refused, not read as the default."""
    from ..errors import UsageError

    if isinstance(raw, str) and not raw.strip():
        raise UsageError(f"{name} is given an empty value (leave the flag out for its default)")
    return raw


# Train flags that only train takes: bench and plan declare them hidden, so that giving one is
# refused with a hint (cli/main.py's _Parser.error) instead of reading as an unknown flag.
TRAIN_ONLY = {"--strategy": "use --strategies A,B,...", "--resume": "resume each run with lowcomm train --resume"}


def hidden(parser: argparse.ArgumentParser, names) -> None:
    for name in names:
        parser.add_argument(name, help=argparse.SUPPRESS)


def target_loss_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--target-loss", metavar="LOSS", help=f"validation loss (nats per token) for the "
                        f"time/bytes-to-target columns (default: {default})")


def target_loss(args) -> float | None:
    """--target-loss, checked: None when not given."""
    if args.target_loss is None:
        return None
    value = convert(args.target_loss, "float", "--target-loss")
    if value <= 0:
        raise UsageError(f"--target-loss must be positive, got {args.target_loss}")
    return value

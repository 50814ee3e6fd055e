"""What the user reads about `lowcomm train`'s flags is what the parser takes: docs/cli.md's table
is the parser's help (written by docs/regenerate_cli.py), and the strategy lists in the help are
the registry's answers, not a list typed once and left behind."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lowcomm.cli.flags import flag_table
from lowcomm.cli.main import build_parser
from lowcomm.strategies import available, get
from lowcomm.strategies.registry import register, unregister
from lowcomm.strategies.zero1 import Zero1

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- flags:train -->\n(.*?)<!-- /flags:train -->", re.S)


def train_parser() -> argparse.ArgumentParser:
    return build_parser(only="train")._subparsers._group_actions[0].choices["train"]


def help_of(flag: str) -> str:
    return next(a.help for a in train_parser()._actions if flag in a.option_strings)


def test_the_flag_table_of_docs_cli_is_the_parsers():
    found = BLOCK.search((ROOT / "docs" / "cli.md").read_text())
    assert found, "docs/cli.md has no <!-- flags:train --> block"
    assert found[1] == flag_table(train_parser()), "docs/cli.md's flag table is stale: run docs/regenerate_cli.py"


def test_the_table_has_a_row_for_every_flag_but_the_strategy_options():
    parser = train_parser()
    options = {s for group in parser._action_groups if group.title == "strategy options"
               for a in group._group_actions for s in a.option_strings}
    taken = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
    rows = re.findall(r"^\| `(--[a-z-]+)", flag_table(parser), re.M)
    assert len(rows) == len(set(rows)) and set(rows) == taken - options
    assert {"--member-timeout", "--replicas", "--inside", "--intra-link"} <= set(rows)


def test_the_table_names_each_flags_toml_key_and_default():
    rows = {row.split(" | ")[0][3:].split()[0].rstrip("`"): row.split(" | ") for row in
            flag_table(train_parser()).splitlines()[2:]}
    assert rows["--lr"][1:3] == ["`optim.lr`", "`0.003`"]
    assert rows["--intra-link"][1:3] == ["`intra_link` or `[intra_link]`", "`none`"]
    assert rows["--resume"][1] == "" and rows["--n-layer"][2] == "the preset's"


class Refusing(Zero1):
    """zero1 that runs neither elastically nor across replicas (it declares no inside_replica of its own)."""

    class elastic(Zero1.elastic):
        @classmethod
        def refusal(cls, options, across_replicas):
            return "a test's strategy"


@pytest.fixture
def refusing_strategy():
    register("refusing")(Refusing)
    try:
        yield "refusing"
    finally:
        unregister("refusing")


def test_the_helps_strategy_lists_are_the_registrys(refusing_strategy):
    names = available()
    elastic = [n for n in names if get(n).elastic.refusal(get(n).Options(), False) is None]
    fsdp = [n for n in names if get(n).runs_inside("fsdp")]
    assert refusing_strategy in names and refusing_strategy not in elastic + fsdp
    assert f"live state ({', '.join(elastic)};" in help_of("--elastic")
    assert f"sharded; {', '.join(fsdp)})" in help_of("--inside")
    assert f"one of: {', '.join(names)})" in help_of("--strategy")


def test_the_help_says_every_strategy_when_every_one_runs_elastic():
    assert all(get(n).elastic.refusal(get(n).Options(), False) is None for n in available())
    assert "live state (every strategy;" in help_of("--elastic")


def test_the_help_says_what_a_step_is_and_what_min_workers_counts():
    assert "each one optimizer update" in help_of("--steps") and "rounds" not in help_of("--steps")
    assert "with --replicas (or under torchrun) it counts replicas" in help_of("--min-workers")

"""What `--help` answers: fast at the top level (no torch imported), every flag with its
unit-bearing metavar and its default, and each subcommand listing only the flags it takes."""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lowcomm
from lowcomm import config as C
from lowcomm.cli.main import build_parser, main
from lowcomm.config.flags import RUN_FLAGS

SRC = Path(lowcomm.__file__).parent


def subparser(name: str) -> argparse.ArgumentParser:
    return build_parser(only=name)._subparsers._group_actions[0].choices[name]


def listed_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """flag -> action, for every flag the parser's --help shows."""
    return {s: a for a in parser._actions if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            for s in a.option_strings}


@pytest.mark.procs
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["report", "--help"]])
def test_top_level_help_and_version_import_no_torch(argv):
    """The way a user runs it; -X importtime lists every module imported before the exit."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lowcomm", *argv], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "numpy", "matplotlib", "rich")}
    assert not heavy, sorted(heavy)[:5]
    if argv == ["--version"]:
        assert proc.stdout.strip() == f"lowcomm {lowcomm.__version__}"
    else:
        assert "usage: lowcomm" in proc.stdout


@pytest.mark.parametrize("command", ["train", "bench", "plan", "report"])
def test_every_flag_shows_its_default_and_a_meaningful_metavar(command):
    for flag, action in listed_flags(subparser(command)).items():
        assert "(default: " in action.help, f"lowcomm {command} {flag}: no default in {action.help!r}"
        if action.nargs != 0:  # takes a value
            assert action.metavar and action.metavar not in ("X", "VALUE"), f"lowcomm {command} {flag}"


def test_defaults_in_help_are_the_configs():
    help_of = {flag: a.help for flag, a in listed_flags(subparser("train")).items()}
    cfg = C.RunConfig()
    assert f"(default: {cfg.steps})" in help_of["--steps"]
    assert f"(default: {cfg.optim.lr:g})" in help_of["--lr"]
    assert f"(default: {cfg.timeout:g})" in help_of["--timeout"] and "seconds" in help_of["--timeout"]
    assert "(default: off)" in help_of["--checkpoint-every"] and "(default: off)" in help_of["--trace"]


def test_each_subcommand_lists_only_what_it_accepts(capsys):
    plan = listed_flags(subparser("plan"))
    for flag in ("--lr", "--data", "--resume", "--overwrite", "--quiet", "--strategy", "--eval-every", "--tokens"):
        assert flag not in plan, flag
    assert {"--workers", "--link", "--params", "--calibrate", "--sync-every"} <= plan.keys()
    bench = listed_flags(subparser("bench"))
    assert "--strategy" not in bench and "--resume" not in bench and {"--strategies", "--tokens", "--lr"} <= bench.keys()
    assert set(listed_flags(subparser("report"))) == {"--out", "--target-loss"}
    # what a subcommand does not list, it refuses in one line naming the flag
    capsys.readouterr()
    assert main(["plan", "--params", "1e6", "--worker-tflops", "1", "--eval-every", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --eval-every does not apply to lowcomm plan "
                                               "(`lowcomm plan --help` lists its flags)")


def test_every_run_flag_is_declared_by_train():
    assert set(RUN_FLAGS) <= set(listed_flags(subparser("train")))


def test_subcommands_do_not_import_the_cli():
    """cli/main.py imports the verbs and the flags; none of them imports it back (no import circle)."""
    for name in ("cli/verbs.py", "cli/bench.py", "cli/plan.py", "cli/report.py", "cli/join.py", "cli/flags.py",
                 "config/flags.py"):
        tree = ast.parse((SRC / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "main" not in imported and "lowcomm.cli.main" not in imported, name

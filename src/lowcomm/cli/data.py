"""`lowcomm data prepare SOURCE --tokenizer T --out DIR`: text to token files (data/prepare.py)."""
from __future__ import annotations

import argparse

from ..errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", metavar="ACTION", help="prepare")


def run(args) -> int:
    raise UsageError("lowcomm data prepare is not available yet")

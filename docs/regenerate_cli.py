#!/usr/bin/env python3
"""Writes docs/cli.md's table of `lowcomm train`'s flags from the parser the CLI builds
(lowcomm.cli.flags.flag_table), between `<!-- flags:train -->` and `<!-- /flags:train -->`.

    .venv/bin/python docs/regenerate_cli.py

tests/cli/test_flag_table.py fails when the page and the flags differ; run this then.
"""
from __future__ import annotations

import re
from pathlib import Path

from lowcomm.cli.flags import flag_table
from lowcomm.cli.main import build_parser

PAGE = Path(__file__).resolve().parent / "cli.md"
BLOCK = re.compile(r"(<!-- flags:train -->\n).*?(<!-- /flags:train -->)", re.S)


def train_parser():
    return build_parser(only="train")._subparsers._group_actions[0].choices["train"]


def main() -> None:
    text = PAGE.read_text()
    if not BLOCK.search(text):
        raise SystemExit(f"{PAGE}: no <!-- flags:train --> block")
    PAGE.write_text(BLOCK.sub(lambda m: m[1] + flag_table(train_parser()) + m[2], text))
    print(f"wrote the flag table of {PAGE}")


if __name__ == "__main__":
    main()

"""`lowcomm join RUNDIR`: one more worker for an elastic run that is training (launch/join.py)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..launch.join import add_join_arguments
    add_join_arguments(parser)


def run(args) -> int:
    from ..launch.join import join
    return join(args)

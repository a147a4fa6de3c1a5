"""The `distbench` command line: a dispatcher over the modules in distbench.commands."""

from __future__ import annotations

import argparse
import sys
import typing

from . import __version__
from .commands import COMMANDS


class Parser(argparse.ArgumentParser):
    """Usage errors in one line with the fix, exit 2, before any heavy import (commands import torch in run)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="distbench", description="Correctness and performance regression suite for distributed training."
    )
    parser.add_argument("--version", action="version", version=f"distbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

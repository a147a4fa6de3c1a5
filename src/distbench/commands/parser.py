"""The `distbench` argument parser, over the command modules it is given (each with `add_parser`)."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from types import ModuleType

from .. import __version__


class Parser(argparse.ArgumentParser):
    """Usage errors in one line with the fix, exit 2, before any heavy import (commands import torch in run)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(commands: Iterable[ModuleType]) -> argparse.ArgumentParser:
    parser = Parser(
        prog="distbench", description="Correctness and performance regression suite for distributed training."
    )
    parser.add_argument("--version", action="version", version=f"distbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in commands:
        module.add_parser(sub)
    return parser

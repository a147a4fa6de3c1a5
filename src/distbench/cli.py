"""The `distbench` command line: parse (commands/parser.py), then run the chosen module of distbench.commands."""

from __future__ import annotations

import sys

from .commands import COMMANDS
from .commands.parser import build_parser
from .runtime import terminate


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(COMMANDS)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    previous = terminate.install()
    try:
        return int(args.func(args) or 0)
    finally:
        terminate.restore(previous)


if __name__ == "__main__":
    sys.exit(main())

"""The `distbench` command line: parse (commands/parser.py), then run the chosen module of distbench.commands."""

from __future__ import annotations

import signal
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
    except KeyboardInterrupt as e:
        # Ctrl-C, or SIGTERM (terminate.Terminated): the command's cleanup ran on the way here, and where the main
        # thread happened to wait is no news to whoever stopped it: one line, and the shell's status for a signal.
        stopped_by = signal.SIGTERM if isinstance(e, terminate.Terminated) else signal.SIGINT
        print(f"distbench {args.command}: stopped by {stopped_by.name}", file=sys.stderr)
        return 128 + stopped_by
    finally:
        terminate.restore(previous)


if __name__ == "__main__":
    sys.exit(main())

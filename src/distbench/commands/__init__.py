"""Subcommands of the `distbench` CLI: one module each, exposing `add_parser(subparsers)` and `run(args)`.

commands/parser.py calls `add_parser` for every module in COMMANDS; `add_parser` sets `func=run`, and `run`
returns the process exit status. Modules import their heavy dependencies inside `run`, so `distbench --help`
stays fast.
"""

from __future__ import annotations

from . import (
    ab,
    bisect,
    calibrate,
    compare,
    doctor,
    history,
    launch,
    nightly,
    recommend,
    report,
    run,
    strategies,
)

COMMANDS = [
    run,
    ab,
    bisect,
    history,
    nightly,
    calibrate,
    launch,
    strategies,
    compare,
    report,
    doctor,
    recommend,
]

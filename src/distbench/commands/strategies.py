"""`distbench strategies`: every strategy with a one-line description and where it runs."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("strategies", help="list strategies, what they do and whether they run on CPU")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..strategies import REGISTRY

    t = Table("strategy", "cpu", "description", title="distbench strategies")
    for spec in REGISTRY.values():
        cpu = "yes" if spec.cpu else f"no ({spec.gpu_only_why})"
        t.add_row(spec.name, cpu, spec.description)
    Console().print(t)
    return 0

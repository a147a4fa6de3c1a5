"""`distbench doctor [--json]`: versions, GPUs, topology, NCCL env and known breakages with their fix."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="check this machine for known breakages (exit 1 if any fail)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..doctor import FAIL, render, run_checks

    checks = run_checks()
    print(json.dumps([c.to_dict() for c in checks], indent=2) if args.json else render(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0

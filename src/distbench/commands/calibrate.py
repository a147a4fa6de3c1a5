"""`distbench calibrate AA...`: the A/B gate's false-alarm rate at this machine's noise, from A/A comparisons."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="the A/B gate's false-alarm rate at this machine's noise, from A/A comparisons",
        description="Read the ab.json of A/A comparisons (`distbench ab` with no --head: a variant against "
        "itself), replay the gate's rule on resamples of each gated metric's centred pairs, and report "
        "the share that raised a false alarm beside the alpha the rule spent, with the A/A verdicts "
        "counted. Comparisons of two different variants in the given folders are skipped, named. Exit "
        "status: 0, or 2 when no A/A comparison is found or a file is damaged.",
    )
    p.add_argument("paths", nargs="+", type=Path, help="ab.json files or folders searched for them")
    p.add_argument("--resamples", type=int, default=2000, help="replays per metric (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="of the resampling (default 0)")
    p.add_argument("--json", type=Path, help="also write every row and the summary as JSON to this file")
    p.set_defaults(func=run)


def _reports(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("ab.json")))]
    if missing := [p for p in paths if not p.exists()]:
        raise FileNotFoundError(f"no such file or folder: {', '.join(map(str, missing))}")
    out = []
    for f in files:
        try:
            out.append((f, json.loads(f.read_text())))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{f}: not a readable ab.json ({e})") from e
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..gate import calibrate as cal
    from ..gate.ab import LOOK_EVERY, MAX_PAIRS, MIN_PAIRS, looks

    console = Console(width=None if Console().is_terminal else 140)
    if args.resamples < 100:
        print("distbench calibrate: --resamples must be at least 100", file=sys.stderr)
        return 2
    try:
        reports = _reports(args.paths)
    except (FileNotFoundError, ValueError) as e:
        print(f"distbench calibrate: {e}", file=sys.stderr)
        return 2
    rows: list[tuple[Path, cal.Calibration]] = []
    family: dict[str, tuple[float, float]] = {}  # comparison -> (replayed chance of any alarm, its alpha)
    for f, report in reports:
        try:
            got = cal.calibrate(
                report,
                resamples=args.resamples,
                seed=args.seed,
                default_looks=looks(MIN_PAIRS, MAX_PAIRS, LOOK_EVERY),
            )
        except ValueError as e:
            console.print(f"skipped {f}: {e}", highlight=False)
            continue
        except (KeyError, TypeError) as e:
            print(f"distbench calibrate: {f}: not an ab.json of distbench ab ({e!r})", file=sys.stderr)
            return 2
        rows += [(f, c) for c in got]
        if got:
            family[str(f)] = (cal.family_rate(got), float(report["alpha"]))
    if not rows:
        print("distbench calibrate: no A/A comparison with enough pairs in the given paths", file=sys.stderr)
        return 2
    t = Table("A/A", "config", "metric", "pairs", "A/A verdict", "noise (SD)", "false alarms", "alpha spent")
    for f, c in rows:
        t.add_row(
            str(f.parent),
            c.label,
            c.metric,
            str(c.pairs),
            c.verdict.upper(),
            f"{c.noise:.2%}",
            f"{c.false_alarm:.2%}",
            f"{c.nominal:.2%}",
        )
    console.print(t)
    calibrations = [c for _, c in rows]
    k, n, (lo, hi) = cal.observed(calibrations)
    console.print(
        f"A/A verdicts: {k} false alarm(s) in {n} gated metric verdicts ({k / n:.1%}, 95% interval "
        f"{lo:.1%}-{hi:.1%}).",
        highlight=False,
    )
    for name, (rate, alpha) in family.items():
        console.print(
            f"{name}: replayed at its noise, any false alarm in {rate:.2%} of comparisons "
            f"({'within' if rate <= alpha else 'ABOVE'} its family-wise alpha of {alpha:.0%})",
            highlight=False,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "rows": [{"file": str(f), **c.__dict__} for f, c in rows],
                    "observed": {"false_alarms": k, "verdicts": n, "ci95": [lo, hi]},
                    "family_rate": {k: {"replayed": r, "alpha": a} for k, (r, a) in family.items()},
                },
                indent=1,
            )
            + "\n"
        )
    return 0

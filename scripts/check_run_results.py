"""Check that a `distbench run` wrote its results: result files newer than a marker, each one loadable, and every
configuration ok. `.ci/run` runs it after the README's first line, whose `distbench run` writes to
distbench-results/ and must leave a result a user can read, not only exit 0.

Usage: python scripts/check_run_results.py DIR MARKER
"""

from __future__ import annotations

import sys
from pathlib import Path

from distbench.results import load_results


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out, marker = Path(argv[0]), Path(argv[1])
    since = marker.stat().st_mtime
    fresh = sorted(p for p in out.rglob("*.json") if p.stat().st_mtime >= since) if out.is_dir() else []
    results = load_results(fresh) if fresh else []
    if not results:
        print(f"check_run_results: `distbench run` wrote no result under {out}/", file=sys.stderr)
        return 1
    failed = [r for r in results if r.get("status") != "ok"]
    for r in failed:
        print(f"check_run_results: {r['id']}: {r.get('status')}: {r.get('error')}", file=sys.stderr)
    print(f"`distbench run` wrote {len(results)} result(s) under {out}/, {len(results) - len(failed)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

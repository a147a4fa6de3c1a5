"""Write the README's line of the versions the CPU tier was last green with, from CI's lock.

CI installs from .ci/constraints.txt and a change lands only when CI is green, so the lock's pins are the
versions the tier last passed with. The README names the few a reader cares about, between two markers; this
script writes that line (scripts/refresh_lock.sh runs it after a refresh) and, with --check, only says whether
the README agrees with the lock (tests/test_readme.py checks the same in the default tier).

    python scripts/readme_versions.py [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from packaging.markers import Marker

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / ".ci" / "constraints.txt"
README = ROOT / "README.md"
#: the packages the line names, as the lock spells them, and as the line does
NAMED = {
    "torch": "torch",
    "transformers": "transformers",
    "deepspeed": "DeepSpeed",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
}
#: the Python of the machine .ci/run runs on: the lock pins some packages per Python, the line names these
CI_PYTHON = "3.11"
BEGIN = "<!-- versions: scripts/readme_versions.py writes the line below from .ci/constraints.txt -->"
END = "<!-- /versions -->"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(?:\s*;\s*(.+))?$", re.M)
#: the marker environment of that machine, whatever Python runs this
_CI = {
    "python_version": CI_PYTHON,
    "python_full_version": f"{CI_PYTHON}.0",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
}


def pins(lock: str) -> dict[str, str]:
    """The named packages' versions in a lock's text, on CI_PYTHON. A named package pinned to two versions there
    has no one version to state: an error, as is one the lock does not pin."""
    found: dict[str, set[str]] = {}
    for name, version, marker in PIN.findall(lock):
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in NAMED and (not marker or Marker(marker).evaluate(_CI)):
            found.setdefault(key, set()).add(version)
    missing = [n for n in NAMED if n not in found]
    if missing:
        raise ValueError(f"{LOCK.relative_to(ROOT)} pins no {', '.join(missing)}")
    several = {n: sorted(v) for n, v in found.items() if len(v) > 1}
    if several:
        raise ValueError(f"{LOCK.relative_to(ROOT)} pins several versions of {several}: the README names one")
    return {n: found[n].pop() for n in NAMED}


def versions_line(versions: dict[str, str]) -> str:
    named = ", ".join(f"{NAMED[n]} {v}" for n, v in versions.items())
    return (
        f"Last green on Python {CI_PYTHON} with {named}: the versions [CI's lock](.ci/constraints.txt) pins."
    )


def with_line(readme: str, line: str) -> str:
    """`readme` with `line` between its markers (the markers must be there, once each)."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise ValueError(f"README.md needs the markers once each, on lines of their own:\n{BEGIN}\n{END}")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{line}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md disagrees with the lock")
    args = parser.parse_args(argv)
    readme = README.read_text(encoding="utf-8")
    try:
        wanted = with_line(readme, versions_line(pins(LOCK.read_text(encoding="utf-8"))))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if wanted == readme:
        return 0
    if args.check:
        print("README.md's versions disagree with .ci/constraints.txt: run python scripts/readme_versions.py")
        return 1
    README.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

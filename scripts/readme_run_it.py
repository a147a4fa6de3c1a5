"""Print the README's set-up lines, one a line: the shell block of its "Run it" section, as a newcomer types it.

`.ci/run` reads them from here at run time and runs them as written, so CI cannot drift from the README: when
the README's lines change, CI runs the new ones; when the section or its block goes, CI fails here, saying so.
Standard library only: it runs before anything is installed.

Usage: python3 scripts/readme_run_it.py [README]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SECTION = "Run it"
_SECTION = re.compile(rf"^## {re.escape(SECTION)}[ \t]*\n(?P<body>.*?)(?=^## |\Z)", re.M | re.S)
_BLOCK = re.compile(r"^```(?:bash|sh|shell)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


class NoRunIt(ValueError):
    """The README has no "Run it" section with a shell block of commands."""


def run_it_lines(readme: str) -> list[str]:
    """The commands of the first shell block of the README's "Run it" section, blank lines and comments left out."""
    section = _SECTION.search(readme)
    if section is None:
        raise NoRunIt(f"no '## {SECTION}' section")
    block = _BLOCK.search(section["body"])
    if block is None:
        raise NoRunIt(f"no ```bash block in '## {SECTION}'")
    lines = [ln.strip() for ln in block["body"].splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    if not commands:
        raise NoRunIt(f"the ```bash block of '## {SECTION}' has no command")
    return commands


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "README.md"
    try:
        lines = run_it_lines(path.read_text(encoding="utf-8"))
    except (OSError, NoRunIt) as e:
        print(
            f"readme_run_it: {path}: {e}: CI runs the README's set-up lines and found none", file=sys.stderr
        )
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

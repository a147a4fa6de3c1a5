"""CI's lock (.ci/constraints.txt): .ci/run installs with it as pip's constraints, so a release on the package
index cannot turn a change red. It must pin, within its range, every requirement CI installs: pyproject.toml's
dependencies, the extras [dev] names, and .ci/constraints.in. A requirement added or narrowed without
`bash scripts/refresh_lock.sh` fails here, not in CI's install."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / ".ci" / "constraints.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)\s*(?:;\s*(.+))?$")


def ci_requirements() -> list[Requirement]:
    """What .ci/run asks pip for: the project's dependencies, the extras of [dev] (expanded), constraints.in."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    wanted, todo, seen = list(map(Requirement, project["dependencies"])), ["dev"], set()
    while todo:
        for line in extras[extra := todo.pop()]:
            r = Requirement(line)
            if canonicalize_name(r.name) == canonicalize_name(project["name"]):
                todo += [e for e in r.extras if e not in seen]
            else:
                wanted.append(r)
        seen.add(extra)
    lines = (ROOT / ".ci" / "constraints.in").read_text(encoding="utf-8").splitlines()
    return wanted + [Requirement(x) for x in lines if x.strip() and not x.startswith("#")]


def lock_errors(requirements: list[Requirement], lock: str) -> list[str]:
    """Each requirement that applies to this Python and that the lock does not pin, or pins outside its range."""
    pinned: dict[str, str] = {}
    for line in lock.splitlines():
        if (m := PIN.match(line)) and (m[3] is None or Marker(m[3]).evaluate()):
            pinned[canonicalize_name(m[1])] = m[2]
    errors = []
    for r in requirements:
        if r.marker is not None and not r.marker.evaluate():
            continue
        version = pinned.get(canonicalize_name(r.name))
        if version is None:
            errors.append(f"{r}: not pinned")
        elif not r.specifier.contains(version, prereleases=True):
            errors.append(f"{r}: pinned to {version}")
    return errors


def test_the_lock_pins_every_requirement_ci_installs_within_its_range():
    requirements = ci_requirements()
    assert {"torch", "deepspeed", "pytest", "hypothesis", "mypy"} <= {r.name for r in requirements}
    assert lock_errors(requirements, LOCK.read_text(encoding="utf-8")) == [], (
        "the lock is behind pyproject.toml or .ci/constraints.in: run bash scripts/refresh_lock.sh"
    )


def test_the_lock_check_catches_a_requirement_unpinned_or_out_of_range():
    lock = LOCK.read_text(encoding="utf-8")
    assert lock_errors([Requirement("no-such-package>=1")], lock) == ["no-such-package>=1: not pinned"]
    assert lock_errors([Requirement("hypothesis<6")], lock)[0].startswith("hypothesis<6: pinned to 6.")
    assert lock_errors([Requirement("torch==2.13.0")], lock) == []
    # a pin for another Python only is no pin here, and a requirement for another Python needs none
    assert lock_errors([Requirement("tomli")], "tomli==2.0 ; python_version < '3'\n") == ["tomli: not pinned"]
    assert lock_errors([Requirement("tomli ; python_version < '3'")], "") == []

"""Write a GPU tier's per-test seconds for the lanes' plan: scripts/tier_durations.py JUNIT_XML OUT_JSON.
An existing OUT_JSON keeps the tests the run did not time (another machine's tier: one GPU, or two); the run's
own figures replace the rest.

pytest's cache holds each test's seconds from the last session on that machine; a fresh runner (a clean
checkout, a new VM) has none, and its lanes would start the costliest tests blind. The ini option
`distbench_durations` names the file this writes, from a tier run's junit XML; the cache's own figures
replace it test by test once the runner has run the tier.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def durations(junit: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None and "UNDECIDED" not in (skipped.get("message") or ""):
            continue  # skipped at collection: no cost to plan
        classname = case.get("classname")
        if not classname:
            continue  # a session cut by SIGINT reports its interruption as a case of no test
        parts = classname.split(".")
        # "tests.test_x.TestY": the longest prefix that is a module of this checkout, then its classes
        i = next((i for i in range(len(parts), 0, -1) if Path(*parts[:i]).with_suffix(".py").exists()), 0)
        if i == 0:
            continue  # not a test of this checkout
        nodeid = "::".join(["/".join(parts[:i]) + ".py", *parts[i:], case.get("name", "")])
        out[nodeid] = round(float(case.get("time", 0)), 2)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    junit, out = map(Path, sys.argv[1:3])
    table = durations(junit)
    kept = json.loads(out.read_text()) if out.exists() else {}
    merged = dict(sorted({**kept, **table}.items()))
    out.write_text(json.dumps(merged, indent=0) + "\n")
    print(
        f"{len(table)} tests timed, {len(merged) - len(table)} kept, {sum(merged.values()):.0f} s, written to {out}"
    )

"""The evidence the README, results/README.md and docs/gate.md cite is in git, and none of it is a dump.

Twice a results folder that a stop note and the README cited (`recommend-h200-2026-11-23/`, the GPU
tier's world-size-1 logs) never reached git: .gitignore kept results/ out but for a hand-kept list. Now
results/ is tracked as a whole, and these checks fail on a cited path that is not in git or a file too
large to be a curated result.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A curated result (a JSON, a report, a log, a figure) is well under this; raw dumps are not.
MAX_BYTES = 400 * 1024
CITED = re.compile(r"(?<![\w/.-])(results/[\w.\-]+(?:/[\w.\-]+)*/?)")


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return set(out.stdout.split())


def cited_paths(text: str) -> set[str]:
    """results/... paths a document names (without trailing punctuation)."""
    return {m.rstrip("/.") for m in CITED.findall(text)}


def test_every_cited_result_is_in_git():
    tracked = _tracked()
    missing = []
    for doc in (ROOT / "README.md", ROOT / "results" / "README.md", ROOT / "docs" / "gate.md"):
        text = doc.read_text()
        # results/README.md names its folders relative to itself, as `name/`
        if doc.parent.name == "results":
            text += " ".join(f" results/{m}" for m in re.findall(r"^- `([\w.\-]+)/`", text, re.M))
        for path in sorted(cited_paths(text)):
            if not any(t == path or t.startswith(path + "/") for t in tracked):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, f"cited but not in git: {missing}"


def test_no_result_file_is_a_dump():
    big = [f for f in _tracked() if (ROOT / f).stat().st_size > MAX_BYTES]
    assert not big, f"over {MAX_BYTES // 1024} KB, keep a summary instead: {big}"


def test_the_citation_check_sees_a_missing_folder():
    assert cited_paths("see results/nowhere-2026-01-01/ and (results/a/b.json).") == {
        "results/nowhere-2026-01-01",
        "results/a/b.json",
    }
    assert not any(t.startswith("results/nowhere-2026-01-01") for t in _tracked())

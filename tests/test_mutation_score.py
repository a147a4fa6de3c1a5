"""The nightly mutation ratchet (scripts/mutation_score.py): a module's score may only go up, a mutant no test
reaches counts against it, and the job's summary names every survivor."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mutation_score.py"
_spec = importlib.util.spec_from_file_location("mutation_score", SCRIPT)
assert _spec is not None and _spec.loader is not None
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)

#: `mutmut results --all true` of two modules: stats 3 detected of 4 judged (one never checked, left out),
#: claims 1 of 3 (a survivor and a mutant no test reaches).
RESULTS = """\
    distbench.gate.stats.x_verdict__mutmut_1: killed
    distbench.gate.stats.x_verdict__mutmut_2: timeout
    distbench.gate.stats.xǁEffectǁworse__mutmut_1: killed
    distbench.gate.stats.x_verdict__mutmut_3: survived
    distbench.gate.stats.x_verdict__mutmut_4: not checked
    distbench.testsuite.claims.x_within__mutmut_1: killed
    distbench.testsuite.claims.x_within__mutmut_2: survived
    distbench.testsuite.claims.x_settle__mutmut_1: no tests
"""


def test_a_modules_score_is_what_its_tests_detect_of_its_mutants_that_ran_or_had_none():
    measured = ms.scores(ms.statuses(RESULTS))
    assert measured == {
        "distbench.gate.stats": {"judged": 4, "detected": 3, "score": 0.75},
        "distbench.testsuite.claims": {"judged": 3, "detected": 1, "score": 0.3333},
    }


@pytest.mark.parametrize(
    "baseline, code",
    [
        ({"distbench.gate.stats": 0.75, "distbench.testsuite.claims": 0.3333}, 0),  # held: passes
        ({"distbench.gate.stats": 0.7}, 0),  # went up; claims not recorded yet: reported, not judged
        ({"distbench.gate.stats": 0.76}, 1),  # dropped
        ({"distbench.plausibility": 0.5}, 1),  # recorded, but the run judged none of its mutants
    ],
)
def test_the_job_fails_only_where_a_score_drops_below_its_baseline(tmp_path, baseline, code):
    results, base, summary = tmp_path / "results.txt", tmp_path / "baseline.json", tmp_path / "summary.md"
    results.write_text(RESULTS)
    base.write_text(json.dumps(baseline))
    assert ms.main([str(results), "--baseline", str(base), "--summary", str(summary)]) == code
    text = summary.read_text()
    assert "`distbench.gate.stats.x_verdict__mutmut_3` (survived)" in text
    assert "`distbench.testsuite.claims.x_settle__mutmut_1` (no tests)" in text
    assert "mutmut_1` (killed)" not in text and "not checked" not in text
    assert ("**dropped**" in text) == bool(code)


def test_update_only_raises_the_baseline(tmp_path):
    results, base = tmp_path / "results.txt", tmp_path / "baseline.json"
    results.write_text(RESULTS)
    base.write_text(json.dumps({"distbench.gate.stats": 0.8, "distbench.plausibility": 0.5}))
    assert ms.main([str(results), "--baseline", str(base), "--update"]) == 0
    assert json.loads(base.read_text()) == {
        "distbench.gate.stats": 0.8,  # measured 0.75: kept
        "distbench.plausibility": 0.5,  # not run: kept
        "distbench.testsuite.claims": 0.3333,  # recorded now
    }


def test_the_committed_baseline_names_modules_the_nightly_mutates():
    """Each module the baseline holds to a score is one `[tool.mutmut] only_mutate` names, and its score a
    share."""
    pyproject = (SCRIPT.parents[1] / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    listed = re.search(r"^only_mutate = \[(.*?)\]", pyproject, re.M | re.S)
    assert listed, "pyproject.toml has no [tool.mutmut] only_mutate"
    patterns = re.findall(r'"([^"]+)"', listed.group(1))
    baseline = json.loads(ms.BASELINE.read_text())
    assert baseline
    for module, score in baseline.items():
        path = "src/" + module.replace(".", "/") + ".py"
        assert any(fnmatch.fnmatch(path, p) for p in patterns), f"{module} is not mutated nightly"
        assert 0 < score <= 1

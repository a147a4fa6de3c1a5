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
        "distbench.gate.stats": {"judged": 4, "detected": 3, "equivalent": 0, "score": 0.75},
        "distbench.testsuite.claims": {"judged": 3, "detected": 1, "equivalent": 0, "score": 0.3333},
    }


def test_a_survivor_listed_as_equivalent_leaves_the_score_and_the_survivors():
    """An equivalent mutant (no outcome can tell it from the original) is neither detected nor missed; only a
    survivor can be listed as one, so a listed name that the tests kill still counts as killed."""
    equivalent = {
        "distbench.gate.stats.x_verdict__mutmut_3": "the two spellings compute the same float",
        "distbench.gate.stats.x_verdict__mutmut_1": "listed by mistake: killed anyway",
    }
    by_mutant = ms.statuses(RESULTS, equivalent)
    assert by_mutant["distbench.gate.stats.x_verdict__mutmut_1"] == "killed"
    assert ms.scores(by_mutant)["distbench.gate.stats"] == {
        "judged": 4,
        "detected": 3,
        "equivalent": 1,
        "score": 1.0,
    }
    assert "x_verdict__mutmut_3" not in ms.summary(ms.scores(by_mutant), {}, by_mutant)


def test_a_listed_equivalent_the_tests_detect_is_named_for_removal():
    """A killed mutant on the equivalent list has a wrong reason, or its name now numbers another mutant,
    whose survival the entry would hide: the summary names it under its own heading; a listed survivor stays
    out of it."""
    equivalent = {
        "distbench.gate.stats.x_verdict__mutmut_3": "the two spellings compute the same float",
        "distbench.gate.stats.x_verdict__mutmut_1": "listed by mistake: killed anyway",
    }
    by_mutant = ms.statuses(RESULTS, equivalent)
    text = ms.summary(ms.scores(by_mutant), {}, by_mutant, equivalent)
    stale = text.split("### Listed equivalent but detected (1): remove from mutation_equivalent.json\n\n")[1]
    assert stale == "- `distbench.gate.stats.x_verdict__mutmut_1` (killed)\n"
    assert "Listed equivalent" not in ms.summary(ms.scores(by_mutant), {}, by_mutant, {})


def score(s: float) -> dict[str, float | int]:
    """A baseline entry of score `s` (the counts do not decide the verdict)."""
    return {"judged": 100, "detected": round(100 * s), "equivalent": 0, "score": s}


@pytest.mark.parametrize(
    "baseline, code",
    [
        ({"distbench.gate.stats": score(0.75), "distbench.testsuite.claims": score(0.3333)}, 0),  # held
        ({"distbench.gate.stats": score(0.7)}, 0),  # went up; claims not recorded yet: reported, not judged
        ({"distbench.gate.stats": score(0.76)}, 1),  # dropped
        ({"distbench.gate.stats": score(0.75), "distbench.testsuite.claims": score(0.34)}, 1),  # one dropped
        ({"distbench.plausibility": score(0.5)}, 1),  # recorded, but the run judged none of its mutants
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
    complete = "".join(line for line in RESULTS.splitlines(keepends=True) if "not checked" not in line)
    results.write_text(complete)
    base.write_text(json.dumps({"distbench.gate.stats": score(0.8), "distbench.plausibility": score(0.5)}))
    assert ms.main([str(results), "--baseline", str(base), "--update"]) == 0
    assert json.loads(base.read_text()) == {
        "distbench.gate.stats": score(0.8),  # measured 0.75: kept
        "distbench.plausibility": score(0.5),  # not run: kept
        "distbench.testsuite.claims": {"judged": 3, "detected": 1, "equivalent": 0, "score": 0.3333},  # new
    }


def test_update_records_no_module_whose_run_was_cut_short(tmp_path):
    """A run stopped by its time limit leaves mutants not checked: the score of the ones judged is not the
    module's, so it is reported and not recorded."""
    results, base = tmp_path / "results.txt", tmp_path / "baseline.json"
    results.write_text(RESULTS.replace("x_within__mutmut_1: killed", "x_within__mutmut_1: not checked"))
    base.write_text("{}")
    assert ms.main([str(results), "--baseline", str(base), "--update"]) == 0
    assert "distbench.testsuite.claims" not in json.loads(base.read_text())
    assert "distbench.gate.stats" not in json.loads(base.read_text())  # its mutmut_4 was not checked either


def test_the_committed_baseline_names_modules_the_nightly_mutates():
    """Each module the baseline holds to a score is one `[tool.mutmut] only_mutate` names, and its score a
    share."""
    pyproject = (SCRIPT.parents[1] / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    listed = re.search(r"^only_mutate = \[(.*?)\]", pyproject, re.M | re.S)
    assert listed, "pyproject.toml has no [tool.mutmut] only_mutate"
    patterns = re.findall(r'"([^"]+)"', listed.group(1))
    baseline = json.loads(ms.BASELINE.read_text())
    assert baseline
    for module, entry in baseline.items():
        path = "src/" + module.replace(".", "/") + ".py"
        assert any(fnmatch.fnmatch(path, p) for p in patterns), f"{module} is not mutated nightly"
        judged, detected, equivalent = entry["judged"], entry["detected"], entry["equivalent"]
        assert 0 < entry["score"] <= 1 and entry["score"] == round(detected / (judged - equivalent), 4)


def toml_list(key: str) -> list[str]:
    """A list of strings under [tool.mutmut] (no tomllib on Python 3.10)."""
    pyproject = (SCRIPT.parents[1] / "pyproject.toml").read_text()
    listed = re.search(rf"^{key} = \[(.*?)\]", pyproject, re.M | re.S)
    assert listed, f"pyproject.toml has no [tool.mutmut] {key}"
    return re.findall(r'"([^"]+)"', listed.group(1))


def test_the_nightly_mutates_every_guarded_module_against_its_guards():
    """[tool.mutmut] is tests/mutation_guards.json: its modules, and the union of their guarding tests; every
    path and test named exists, and every equivalent mutant is one of a mutated module, with its reason."""
    guards = json.loads(ms.GUARDS.read_text())
    assert sorted(toml_list("only_mutate")) == sorted(guards)
    assert sorted(toml_list("pytest_add_cli_args_test_selection")) == sorted(
        {t for ts in guards.values() for t in ts}
    )
    root = SCRIPT.parents[1]
    for path in [*guards, *(t for ts in guards.values() for t in ts)]:
        file, _, test = path.partition(
            "::"
        )  # a module's tests, or one test of a module whose others are slow
        assert (root / file).is_file() and (not test or f"def {test}(" in (root / file).read_text()), path
    modules = {ms.module_name(p) for p in guards}
    for name, reason in json.loads(ms.EQUIVALENT.read_text()).items():
        assert ms.module_of(name) in modules and reason.strip(), name


def test_the_docs_table_is_the_baselines():
    """docs/mutation-testing.md's table is `mutation_score.py --table`: every guarded module, its recorded counts
    or "not yet run", never a figure typed by hand."""
    docs = (SCRIPT.parents[1] / "docs" / "mutation-testing.md").read_text()
    start, end = docs.index(ms.TABLE_START) + len(ms.TABLE_START), docs.index(ms.TABLE_END)
    expected = ms.table(json.loads(ms.BASELINE.read_text()), json.loads(ms.GUARDS.read_text()))
    assert docs[start:end].strip() == expected.strip(), (
        "regenerate it: python scripts/mutation_score.py --table"
    )


def test_the_table_says_not_yet_run_for_a_module_without_a_score():
    text = ms.table(
        {"distbench.compare": score(0.9)}, {"src/distbench/compare.py": [], "src/distbench/x.py": []}
    )
    assert "| `distbench.compare` | 100 | 90 | 0 | 90.0% |" in text
    assert "| `distbench.x` | not yet run | | | |" in text

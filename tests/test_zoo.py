"""The zoo of real upstream regressions (zoo/cases.yaml, scripts/zoo.py): every case is complete and valid, and
the runner's decision fails a case whose bad release passes the gate, whose good release fails it, or that no
check reaches, and never counts a broken run as a catch. Nothing here builds a virtualenv."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml
from packaging.version import Version
from pydantic import ValidationError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "zoo.py"
_spec = importlib.util.spec_from_file_location("zoo", SCRIPT)
assert _spec is not None and _spec.loader is not None
zoo = importlib.util.module_from_spec(_spec)
sys.modules["zoo"] = zoo  # dataclasses look their module up while the script loads
_spec.loader.exec_module(zoo)

CASES = zoo.load()
RAW = yaml.safe_load(zoo.CASES.read_text())


def test_the_zoo_holds_six_real_regressions_of_every_kind_each_with_its_link_and_releases():
    assert len(CASES) >= 6
    assert {c.kind for c in CASES} == {"correctness", "checkpoint", "speed"}
    for c in CASES:
        repo = zoo.REPOS[c.package]
        assert any(
            f"github.com/{repo}/issues/" in str(u) or f"github.com/{repo}/pull/" in str(u) for u in c.links
        )
        assert Version(c.good) < Version(c.bad) and (c.fixed is None or Version(c.bad) < Version(c.fixed))
        assert c.gap or any(k.must_catch for k in c.checks), c.id


def test_every_check_is_a_command_of_the_gate_on_this_checkout():
    """An ab check gets the good release as base and the side under test as head; a suite check runs pytest
    under the side's interpreter, over test modules that exist."""
    good, bad = Path("/v/deepspeed-1/bin/python"), Path("/v/deepspeed-2/bin/python")
    for case in CASES:
        for check in case.checks:
            argv, home = zoo.command(check, good, bad, Path("/out"))
            if check.kind == "ab":
                assert argv[argv.index("--base") + 1].startswith(f"python={good},")
                assert argv[argv.index("--head") + 1].startswith(f"python={bad},") and home == good
                assert (
                    "env.TORCH_EXTENSIONS_DIR=/v/deepspeed-2/torch_extensions"
                    in argv[argv.index("--head") + 1]
                )
            else:
                assert argv[:3] == [str(bad), "-m", "pytest"] and home == bad
                tests = [a for a in check.args if a.startswith("tests/")]
                assert tests and all((SCRIPT.parents[1] / t.split("::")[0]).is_file() for t in tests)


def _case(**changes) -> dict:
    case = {**RAW["cases"][0], **changes}
    return {"cases": [case]}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"good": "0.17.6"}, "must come before"),
        ({"fixed": "0.17.0"}, "must come after"),
        ({"links": ["https://github.com/huggingface/transformers/issues/1"]}, "link the upstream issue"),
        ({"links": []}, "at least 1"),
        ({"good": "not-a-version"}, "Invalid version"),
        ({"kind": "style"}, "correctness"),
        ({"checks": []}, "no check must catch it"),
        ({"gap": "the gate lacks nothing"}, "no gap"),
        ({"surprise": 1}, "Extra inputs"),
    ],
)
def test_a_bad_case_is_refused_naming_what_is_wrong(changes, message):
    with pytest.raises(ValidationError, match=message):
        zoo.Zoo.model_validate(_case(**changes))


def test_a_check_that_need_not_catch_must_say_why_and_may_not_set_the_variants():
    check = {"name": "x", "kind": "ab", "args": ["--numerics", "only"], "must_catch": False}
    with pytest.raises(ValidationError, match="is a gap"):
        zoo.Check.model_validate(check)
    with pytest.raises(ValidationError, match="sets --base and --head"):
        zoo.Check.model_validate({**check, "must_catch": True, "args": ["--head", "python=x"]})
    with pytest.raises(ValidationError, match="ids repeat"):
        zoo.Zoo.model_validate({"cases": [RAW["cases"][0], RAW["cases"][0]]})


@pytest.mark.parametrize(
    ("kind", "rc", "verdict"),
    [
        ("ab", 0, "pass"),
        ("ab", 1, "caught"),
        ("ab", 4, "caught"),
        ("ab", 3, "error"),
        ("ab", 2, "error"),
        ("suite", 0, "pass"),
        ("suite", 1, "caught"),
        ("suite", 2, "error"),
        ("suite", 5, "error"),
        ("suite", 124, "error"),
    ],
)
def test_only_the_checks_own_failure_counts_as_a_catch(kind, rc, verdict):
    """An undecided gate, a usage error, an interrupted or empty pytest run, a timeout: none is a catch."""
    assert zoo.verdict_of(kind, rc) == verdict


def _runs(case, good: dict[str, int], bad: dict[str, int]) -> list:
    out = []
    for side, rcs in (("good", good), ("bad", bad)):
        for check in case.checks:
            if check.name in rcs:
                out.append(
                    zoo.Run(
                        case.id,
                        check.name,
                        side,
                        zoo.verdict_of(check.kind, rcs[check.name]),
                        rcs[check.name],
                        1.0,
                        "log",
                    )
                )
    return out


def test_the_decision_fails_a_case_the_gate_passes_on_its_bad_release():
    """The planted fakes: canned exit statuses for the accumulation case's two checks (both must catch), and for
    a copy whose ab-numerics is a known gap (as it was before ab's numerics trained the recipes)."""
    case = next(c for c in CASES if c.id == "ds-0.17.6-zero12-accumulation")
    held = zoo.decide(case, _runs(case, {"suite": 0, "ab-numerics": 0}, {"suite": 1, "ab-numerics": 4}))
    assert held.ok and held.caught_by == ("suite", "ab-numerics")
    missed = zoo.decide(case, _runs(case, {"suite": 0, "ab-numerics": 0}, {"suite": 1, "ab-numerics": 0}))
    assert not missed.ok and missed.problems == ("ab-numerics: pass on the bad release 0.17.6 (exit 0)",)
    false_alarm = zoo.decide(
        case, _runs(case, {"suite": 1, "ab-numerics": 0}, {"suite": 1, "ab-numerics": 4})
    )
    assert not false_alarm.ok and "on the good release 0.17.5" in false_alarm.problems[0]
    broken = zoo.decide(case, _runs(case, {"suite": 0, "ab-numerics": 0}, {"suite": 2, "ab-numerics": 4}))
    assert not broken.ok and "error on the bad release" in broken.problems[0]
    unrun = zoo.decide(case, _runs(case, {"suite": 0}, {"suite": 1}))
    assert not unrun.ok and unrun.problems == ("ab-numerics: not run on both releases",)
    known_gap = case.model_copy(
        update={
            "checks": [
                c
                if c.name == "suite"
                else c.model_copy(update={"must_catch": False, "gap": "one micro-batch"})
                for c in case.checks
            ]
        }
    )
    held_with_gap = zoo.decide(
        known_gap, _runs(case, {"suite": 0, "ab-numerics": 0}, {"suite": 1, "ab-numerics": 0})
    )
    assert held_with_gap.ok and held_with_gap.caught_by == ("suite",)
    gap_alarm = zoo.decide(
        known_gap, _runs(case, {"suite": 0, "ab-numerics": 4}, {"suite": 1, "ab-numerics": 4})
    )
    assert not gap_alarm.ok and gap_alarm.problems == (
        "ab-numerics: caught on the good release 0.17.5 (exit 4)",
    )


def test_a_case_no_check_reaches_fails_the_run_and_the_table_says_so(tmp_path, capsys):
    """The zoo's last gaps were closed (the two bf16 stage-0 cases, by zero0): a planted one, beside the real
    cases, in a copy of the case file."""
    planted = {**RAW["cases"][0], "id": "planted-gap", "checks": [], "gap": "the gate needs a planted thing"}
    cases = tmp_path / "cases.yaml"
    cases.write_text(yaml.safe_dump({"cases": [*RAW["cases"], planted]}))
    gap = next(c for c in zoo.load(cases) if c.gap)
    assert not zoo.decide(gap, []).ok

    caught = next(c for c in CASES if c.id == "ds-0.17.6-zero12-accumulation")

    def fake(case, venvs, out, timeout):
        return _runs(case, {"suite": 0, "ab-numerics": 0}, {"suite": 1, "ab-numerics": 4})

    out = tmp_path / "out"
    args = ["--venvs", str(tmp_path / "v"), "-o", str(out), "--cases", str(cases), "--case", caught.id]
    assert zoo.main(args, runner=fake) == 0
    assert (
        "| ds-0.17.6-zero12-accumulation | deepspeed 0.17.5 -> 0.17.6 | suite | yes | pass | caught |"
        in (out / "zoo.md").read_text()
    )
    assert zoo.main([*args, "--case", gap.id], runner=fake) == 1
    assert f"**{gap.id}**: gap: " in (out / "zoo.md").read_text()
    with pytest.raises(SystemExit):
        zoo.main(["--case", "no-such-case"])
    assert "no such case" in capsys.readouterr().err


def test_the_nightly_runs_the_whole_zoo_and_keeps_its_table():
    """Scheduled with the other nightly jobs: every case (no --case), its table in the job summary and the
    results folder uploaded whatever the outcome."""
    job = yaml.safe_load((SCRIPT.parents[1] / ".github" / "workflows" / "nightly.yml").read_text())["jobs"][
        "zoo"
    ]
    (step,) = [s for s in job["steps"] if "scripts/zoo.py" in s.get("run", "")]
    assert (
        "--case" not in step["run"]
        and "--github-summary" in step["run"]
        and "--output zoo-results" in step["run"]
    )
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["if"] == "always()" and upload["with"]["path"] == "zoo-results"

"""The suite's own time, by phase: every train job reports where its time went, the pytest process adds the
pool's start and the transfer, and the session prints the table (the next slowdown of the suite shows)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from distbench.jobs.train import train
from distbench.runtime.phases import OWN, POOL_START, SHARED, TRANSFER, PhaseClock, PhaseLog, job_phases

pytest_plugins = ["pytester"]


def test_a_clock_adds_up_each_phase():
    """Two 20 ms sleeps add up to at least 40 ms and to no more than a clock around both read (no fixed upper
    band: on shared cores a sleep wakes late)."""
    clock = PhaseClock()
    t0 = time.perf_counter()
    for _ in range(2):
        with clock("steps"):
            time.sleep(0.02)
    around = time.perf_counter() - t0
    with pytest.raises(RuntimeError), clock("save"):
        raise RuntimeError("a failing phase is still timed")
    assert 0.04 <= clock.seconds["steps"] <= around and "save" in clock.seconds


def test_job_phases_take_the_slowest_rank_and_charge_the_rest_to_transfer():
    outs = [
        {"phases": {"build and wrap": 1.0, "training steps": 2.0}},
        {"phases": {"build and wrap": 1.5, "training steps": 1.0}},
    ]
    phases = job_phases(outs, wall_s=6.0, start_s=2.0)
    assert phases == {"build and wrap": 1.5, "training steps": 2.0, POOL_START: 2.0, TRANSFER: 0.5}
    assert job_phases([{"losses": []}], 1.0, 0.0) is None  # jobs that report no phases add nothing


def test_the_table_lists_phases_and_the_slowest_tests():
    log = PhaseLog()
    log.add("t::a", {"training steps": 3.0, TRANSFER: 1.0})
    log.add("t::b", {"training steps": 1.0})
    log.add("t::a", {"training steps": 1.0})
    lines = log.table()
    assert lines[1].split()[:3] == ["training", "steps", "5.0"] and "83.3%" in lines[1]
    assert any(line.endswith("t::a (training steps 4.0, transfer and rest 1.0)") for line in lines)


def test_the_phase_table_aligns_its_longest_phase_names():
    """The seconds and shares stand in one column however long a phase's name ("shared runs: wait and read")."""
    log = PhaseLog()
    log.add("t::a", {"training steps": 3.0, SHARED: 1.0, OWN: 0.5})
    rows = log.table()[:4]
    assert len({len(row) for row in rows}) == 1, rows
    assert {row.index("%") for row in rows[1:]} == {len(rows[0]) - 1}


def test_each_tests_rest_goes_to_its_own_process():
    """With the remainders the table accounts for the tests' whole time, not only their rank jobs."""
    log = PhaseLog()
    log.add("t::a", {"training steps": 3.0, SHARED: 1.0})
    log.add_remainders({"t::a": 5.5, "t::b": 0.25, "t::c": 0.0})
    assert log.by_test == {"t::a": {"training steps": 3.0, SHARED: 1.0, OWN: 1.5}, "t::b": {OWN: 0.25}}


def test_a_train_job_reports_its_phases_to_the_session(suite, request):
    """The phases of a job add up to the job's wall clock as the session saw it (imports before it excluded:
    under load, importing the strategies took 0.6 s more than a 5% slack)."""
    cfg = suite.config("ddp", 2)
    t0 = time.perf_counter()
    outs = suite.run_job(2, train, cfg=cfg, return_params=True)
    wall = time.perf_counter() - t0
    phases = suite.phases.by_test[request.node.nodeid]
    assert {"build and wrap", "training steps", "gather full state", "teardown", TRANSFER} <= set(phases)
    assert all(s >= 0 for s in phases.values())
    # Each phase is charged at its slowest rank: where ranks are slowest in different phases (more so on shared
    # cores), the sum exceeds the wall by that over-count, measured here from the ranks' own phases.
    ranks = [o["phases"] for o in outs]
    overcount = sum(max(r[k] for r in ranks) for k in ranks[0]) - max(sum(r.values()) for r in ranks)
    assert wall * 0.95 - 0.05 <= sum(phases.values()) <= wall + overcount, (phases, wall, overcount)


def test_the_session_writes_its_phases_as_json_when_asked(pytester):
    """The data behind the phase table, per test, for committing a GPU tier's durations."""
    pytester.makepyfile(
        test_one="""
        from distbench.testsuite.plugin import PHASES
        from distbench.runtime.phases import PhaseLog

        def test_a(request):
            request.config.stash.setdefault(PHASES, PhaseLog()).add(request.node.nodeid, {"training steps": 1.5})
    """
    )
    out = pytester.path / "phases.json"
    result = pytester.runpytest_inprocess("-p", "distbench.testsuite.plugin", f"--phases-json={out}")
    result.assert_outcomes(passed=1)
    phases = json.loads(out.read_text())["test_one.py::test_a"]
    assert phases.pop("training steps") == 1.5 and set(phases) <= {OWN}  # and the test's own rest, if any
    result.stdout.fnmatch_lines(["*time in tests by phase*", "training steps*1.5*"])


def test_the_session_writes_when_each_test_ran_when_asked(pytester):
    """The timeline: which tests overlapped in lanes and what a session ended on (the GPU tier's evidence)."""
    pytester.makepyfile(
        test_two="""
        import time

        def test_a():
            time.sleep(0.2)

        def test_b():
            pass
    """
    )
    out = pytester.path / "timeline.json"
    result = pytester.runpytest_inprocess("-p", "distbench.testsuite.plugin", f"--timeline-json={out}")
    result.assert_outcomes(passed=2)
    timeline = json.loads(out.read_text())
    assert timeline["samples"] == []  # no GPU watched on the CPU tier
    spans = timeline["tests"]
    assert list(spans) == ["test_two.py::test_a", "test_two.py::test_b"]
    (a0, a1), (b0, b1) = spans.values()
    assert a0 == 0.0 and a1 - a0 >= 0.2 and a1 <= b0 <= b1


def test_a_slow_end_of_the_session_says_what_it_waited_on(pytester, monkeypatch):
    """The rank pools' close and the shelf's removal come after the summary, yet a command's wall clock
    includes them (10-20 s at the 2-GPU tier's end): past END_SAY_S the session says how long they took, and
    its shelf is gone afterwards."""
    from distbench.testsuite import plugin

    pytester.makepyfile(
        test_end="""
        from pathlib import Path
        from distbench.testsuite.plugin import session_facts

        def test_makes_the_shelf(request):
            shelf = Path(session_facts(request.config)["shelf"])
            (shelf / "run.bin").write_bytes(b"0" * 1024)
            Path("shelf.txt").write_text(str(shelf))
        """
    )
    monkeypatch.setattr(plugin, "END_SAY_S", -1.0)
    result = pytester.runpytest_inprocess("-p", "distbench.testsuite.plugin")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines(
        [r"distbench: the session's end took [0-9.]+ s: closing its rank pools [0-9.]+ s"]
    )
    shelf = (pytester.path / "shelf.txt").read_text()
    assert not Path(shelf).exists()
    monkeypatch.setattr(plugin, "END_SAY_S", 60.0)
    quiet = pytester.runpytest_inprocess("-p", "distbench.testsuite.plugin")
    assert "the session's end took" not in quiet.stdout.str()

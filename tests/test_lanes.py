"""Lanes on CPU slots (`--lanes 2`): what `pytest -m gpu` does on a machine of 2 GPUs, shown without GPUs.

World-size-1 tests run in two lane processes at once, world-size-2 tests after them, `exclusive` tests with
nothing else running; what the lanes report (failures, skips, errors, a lane process killed or hung, their
phase tables) reaches the one session the user started, its summary, its junit XML and its exit status.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

#: Each test here starts child pytest sessions (~25 s together on 2 cores): the slow tier, which CI runs too.
pytestmark = pytest.mark.slow

pytest_plugins = ["pytester"]

SRC = Path(__file__).resolve().parents[1] / "src"

RECORD = """
import json, os, time
from pathlib import Path

LOG = Path(os.environ["LANES_LOG"])

def record(name, seconds, wait_for=None):
    t0 = time.time()
    if wait_for:  # both lanes' first tests wait for each other: passes only if the lanes run at once
        (LOG.parent / name).touch()
        while not (LOG.parent / wait_for).exists():
            assert time.time() - t0 < 60, f"{wait_for} never started beside {name}"
            time.sleep(0.05)
    time.sleep(seconds)
    with open(LOG, "a") as f:
        f.write(json.dumps({"name": name, "start": t0, "end": time.time(), "pid": os.getpid(),
                            "lane": os.environ.get("DISTBENCH_LANE")}) + "\\n")
"""

CONCURRENT = {
    "record.py": RECORD,
    "test_one.py": """
from record import record
def test_one_a(): record("one_a", 0.2, wait_for="two_a")
def test_one_b(): record("one_b", 0.2)
""",
    "test_two.py": """
from record import record
def test_two_a(request):
    from distbench.testsuite.plugin import PHASES
    from distbench.runtime.phases import PhaseLog
    request.config.stash.setdefault(PHASES, PhaseLog()).add(request.node.nodeid, {"training steps": 7.5})
    record("two_a", 0.2, wait_for="one_a")
def test_two_b(): record("two_b", 0.2)
""",
    "test_whole.py": """
import pytest
from record import record
@pytest.mark.world_size(2)
def test_whole_a(): record("whole_a", 0.2)
@pytest.mark.world_size(2)
def test_whole_b(): record("whole_b", 0.2)
""",
    "test_alone.py": """
import os
import pytest
from pathlib import Path
from record import record
pytestmark = pytest.mark.exclusive
def test_alone(suite):
    here = Path(os.environ["LANES_LOG"])
    here.with_name("warm").write_text(str(suite.pool_manager.pool_for(1).alive))
    lanes = sorted(p.name for p in Path(os.environ["TMPDIR"]).glob("distbench-lanes-*/lane*"))
    here.with_name("lane_dirs").write_text(" ".join(lanes))
    record("alone", 0.3)
""",
}

OUTCOMES = {
    "test_mixed.py": """
import pytest
@pytest.fixture
def broken():
    raise RuntimeError("fixture broke in a lane")
def test_fails(): assert 1 == 2, "planted failure in a lane"
def test_skips(): pytest.skip("planted skip in a lane")
def test_errors(broken): pass
@pytest.mark.xfail(reason="planted xfail")
def test_xfails(): assert False
def test_passes(): pass
""",
    "test_dies.py": """
import os, signal
def test_dies():
    print("last words of the lane", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
def test_after_death(): pass
""",
    "test_hangs.py": """
import time
def test_hangs():
    print("hanging in a lane", flush=True)
    time.sleep(600)
def test_after_hang(): pass
""",
}


def session(tmp: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """A whole pytest session over `files` in its own process, as a user runs it."""
    for name, text in files.items():
        (tmp / name).write_text(text)
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        **env,
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "distbench.testsuite.plugin",
            "-p",
            "no:cacheprovider",
            "-rA",
            *args,
        ],
        cwd=tmp,
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
    )


def intervals(log: Path) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in map(json.loads, log.read_text().splitlines())}


def overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


#: The concurrent session's expected seconds (distbench_durations), so that its plan is fixed: test_two's tests
#: are long (each at least LONG_UNIT_SHARE of the one-rank phase), so each is a unit of its own and they lead;
#: test_one's two are short, one unit that one lane runs in turn. With every test at the default cost both
#: modules were long and split, and whether one_a and one_b met in one lane was a race of the lanes' requests.
PLANNED = {
    "pytest.ini": "[pytest]\ndistbench_durations = durations.json\n",
    "durations.json": json.dumps(
        {"test_one.py::test_one_a": 0.1, "test_one.py::test_one_b": 0.1}
        | {"test_two.py::test_two_a": 20.0, "test_two.py::test_two_b": 20.0}
    ),
}


@pytest.fixture(scope="module")
def concurrent(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    tmp = tmp_path_factory.mktemp("concurrent")
    (tmp / "tmpdir").mkdir()
    out = session(
        tmp,
        {**CONCURRENT, **PLANNED},
        "--lanes",
        "2",
        LANES_LOG=str(tmp / "log.jsonl"),
        TMPDIR=str(tmp / "tmpdir"),
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    return out, intervals(tmp / "log.jsonl")


SOLO = {
    "record.py": RECORD,
    "test_whole.py": CONCURRENT["test_whole.py"],
    "test_one.py": """
from record import record
def test_one_a(): record("one_a", 0.2, wait_for="solo")
""",
    "test_exclusive.py": """
import pytest
from record import record
pytestmark = pytest.mark.exclusive
def test_solo(): record("solo", 0.2, wait_for="one_a")
@pytest.mark.world_size(2)
def test_alone(): record("alone", 0.2)
""",
}


def test_one_rank_exclusive_tests_run_on_a_slot_of_their_own_beside_a_lane_on_the_other(tmp_path):
    """`--solo on` (auto does it on 2+ GPUs): once the world-size-2 lane is done, the one-rank exclusive test
    runs in a lane on the last slot while a one-rank lane runs on the first (each waits for the other to start:
    it passes only if they run at once); the world-size-2 exclusive test still runs here, after every lane."""
    out = session(tmp_path, SOLO, "--lanes", "2", "--solo", "on", LANES_LOG=str(tmp_path / "log.jsonl"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    runs = intervals(tmp_path / "log.jsonl")
    assert runs["solo"]["lane"] == "1" and runs["one_a"]["lane"] == "0"
    assert overlap(runs["solo"], runs["one_a"])
    assert runs["solo"]["start"] >= max(runs[n]["end"] for n in ("whole_a", "whole_b"))
    assert runs["alone"]["lane"] is None
    assert runs["alone"]["start"] >= max(r["end"] for n, r in runs.items() if n != "alone")
    assert "1 one-rank exclusive on a device of their own, then 1 exclusive alone" in out.stdout
    assert re.search(r"the one-rank exclusive tests \d+-\d+ s into them on a device of their own", out.stdout)


def test_world_size_1_runs_in_two_lanes_at_once(concurrent):
    _, runs = concurrent
    assert overlap(runs["one_a"], runs["two_a"])
    assert {runs[n]["lane"] for n in ("one_a", "one_b")} | {runs[n]["lane"] for n in ("two_a", "two_b")} == {
        "0",
        "1",
    }
    assert runs["one_a"]["lane"] == runs["one_b"]["lane"], "a module's tests share one lane"
    assert runs["one_a"]["pid"] != runs["two_a"]["pid"]


def test_world_size_2_runs_in_a_lane_on_both_slots_once_they_are_free(concurrent):
    _, runs = concurrent
    lanes_end = max(runs[n]["end"] for n in ("one_a", "one_b", "two_a", "two_b"))
    for name in ("whole_a", "whole_b"):
        assert runs[name]["start"] >= lanes_end, f"{name} started while a lane held one of its slots"
        assert runs[name]["lane"] == "0,1", "world size 2 takes a seat on each of the two slots"


def test_an_exclusive_test_runs_with_nothing_else_running(concurrent):
    _, runs = concurrent
    alone = runs.pop("alone")
    assert runs, "no other test recorded its interval"
    assert not [n for n, r in runs.items() if overlap(alone, r)]
    assert alone["lane"] is None


def test_the_exclusive_tests_pool_is_warm_before_they_run(concurrent, tmp_path_factory):
    """Started while the lanes ended (LaneRunner's warm_up): the first exclusive test does not pay for it."""
    (log,) = Path(tmp_path_factory.getbasetemp()).glob("concurrent[0-9]*/warm")
    assert log.read_text() == "True"


def test_each_lanes_directory_is_gone_before_the_exclusive_tests(concurrent, tmp_path_factory):
    """A lane's directory holds its tests' tmp_path (checkpoints: GiB each on GPUs): it goes as the lane ends,
    not all at once at the session's end, where its removal held up the command; and the session leaves
    nothing of its own in the temp directory (torch may keep its compile cache there)."""
    (root,) = Path(tmp_path_factory.getbasetemp()).glob("concurrent[0-9]*")
    assert (root / "lane_dirs").read_text() == "", "lane directories were left when the exclusive test ran"
    assert list((root / "tmpdir").glob("distbench-*")) == []


def test_the_session_reports_every_lane_test_and_merges_the_phase_tables(concurrent):
    out, _ = concurrent
    assert "7 passed" in out.stdout
    assert "distbench lanes on 2 slot(s), up to 1 per device" in out.stdout
    assert "tests at once:" in out.stdout and "lanes: 3 started on 2 slot(s)" in out.stdout
    assert (
        "s of lanes (fewer than 1 tests at once for" in out.stdout
        and "s of exclusive tests alone" in out.stdout
    )
    assert re.search(
        r"before the exclusive tests: [0-9.]+ s for the last removals and the warm-up, then [0-9.]+ [MG]iB of "
        r"dirty page cache written out in",
        out.stdout,
    )
    assert re.search(
        r"lane processes exited [0-9.]+-[0-9.]+ s after being told no work was left; closing their rank pools "
        r"took [0-9.]+-[0-9.]+ s",
        out.stdout,
    )
    start = re.search(r"stages: (\d+) s of start \(imports, collection\)", out.stdout)
    assert start and int(start.group(1)) < 60, out.stdout[-2000:]
    table = out.stdout.split("distbench: time in tests by phase")[1]
    assert "training steps" in table and "test_two.py::test_two_a" in table


SHARED = {
    "record.py": RECORD,
    "test_one.py": """
from record import record
def test_one_a(): record("one_a", 0.2, wait_for="two_a")
""",
    "test_two.py": """
from record import record
def test_two_a(): record("two_a", 0.2, wait_for="one_a")
""",
    "test_oom.py": """
import os
def test_fits_only_alone():
    if os.environ.get("DISTBENCH_LANE"):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (planted: a neighbour holds it)")
""",
}

#: Two modules, so two units: two lanes, each with its own 2-rank pool
POOLS = {
    f"test_pool_{me}.py": f"""
import pytest
from record import record
from distbench.jobs.train import train
@pytest.mark.world_size(2)
def test_pool_{me}(suite):
    assert suite.pool_manager.pool_for(2).alive, "the lane spawns its first unit's pool before it collects"
    record("pool_{me}", 0.0, wait_for="pool_{other}")
    losses = suite.run_job(2, train, cfg=suite.config("ddp", 2, steps=2))[0]["losses"]
    record("pool_{me}_trained", 0.0, wait_for="pool_{other}_trained")
    assert len(losses) == 2
"""
    for me, other in (("a", "b"), ("b", "a"))
}
#: A strategy's shelved run, removed once its unit is done
POOLS["test_shelved.py"] = """
import pytest
@pytest.mark.strategies("ddp")
def test_shelved(suite, strategy, world_size):
    if world_size != 2:
        pytest.skip("world size 2 is enough")
    assert suite.checkpointed_run(suite.config(strategy, world_size, steps=2))["losses"]
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Lanes sharing device slots: two world-size-1 lanes on one slot, then two world-size-2 lanes whose own
    2-rank pools train at once on the same two slots."""
    tmp = tmp_path_factory.mktemp("lanes")
    one = session(tmp, SHARED, "--lanes", "1", "--lanes-per-device", "2", LANES_LOG=str(tmp / "one.jsonl"))
    assert one.returncode == 0, one.stdout[-4000:] + one.stderr[-2000:]
    for name in ("test_one.py", "test_two.py", "test_oom.py"):
        (tmp / name).unlink()
    two = session(
        tmp,
        POOLS,
        "--lanes",
        "2",
        "--lanes-per-device",
        "2",
        LANES_LOG=str(tmp / "two.jsonl"),
    )
    assert two.returncode == 0, two.stdout[-4000:] + two.stderr[-2000:]
    assert "up to 2 per device" in one.stdout and "up to 2 per device" in two.stdout
    # out of memory beside another lane: rerun alone, and only that run is reported
    assert "so rerun alone: test_oom.py::test_fits_only_alone" in one.stdout
    assert "PASSED test_oom.py::test_fits_only_alone" in one.stdout and "3 passed" in one.stdout
    removed = re.search(
        r"shelved runs and checkpoints: ([0-9.]+) MiB removed as their strategies finished \(in [0-9.]+ s\)",
        two.stdout,
    )
    assert removed and float(removed.group(1)) > 0, two.stdout[-2000:]  # ddp's checkpoint went with its unit
    return {**intervals(tmp / "one.jsonl"), **intervals(tmp / "two.jsonl")}


def test_two_lanes_share_one_slot_at_once(shared):
    assert overlap(shared["one_a"], shared["two_a"])
    assert shared["one_a"]["lane"] == shared["two_a"]["lane"] == "0"
    assert shared["one_a"]["pid"] != shared["two_a"]["pid"]


def test_two_world_size_2_pools_train_on_the_same_two_slots_at_once(shared):
    a, b = shared["pool_a_trained"], shared["pool_b_trained"]
    assert a["lane"] == b["lane"] == "0,1" and a["pid"] != b["pid"]
    # each waited for the other before and after training: both pools were up at the same time
    assert shared["pool_a"]["start"] < b["end"] and shared["pool_b"]["start"] < a["end"]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], ET.Element]:
    tmp = tmp_path_factory.mktemp("lanes")
    out = session(tmp, OUTCOMES, "--lanes", "3", "--lane-timeout", "3", "--junitxml", str(tmp / "junit.xml"))
    return out, ET.parse(tmp / "junit.xml").getroot()


def _junit(root: ET.Element) -> dict[str, str]:
    """testcase name -> its outcome in the junit XML."""
    got = {}
    for case in root.iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        got[case.get("name", "")] = kinds[0] if kinds else "passed"
    return got


def test_failures_skips_and_errors_in_lanes_reach_the_summary_junit_and_exit_status(outcomes):
    out, root = outcomes
    assert out.returncode == 1, out.stdout[-3000:]
    for line in (
        "FAILED test_mixed.py::test_fails - AssertionError: planted failure in a lane",
        "ERROR test_mixed.py::test_errors - RuntimeError: fixture broke in a lane",
        "XFAIL test_mixed.py::test_xfails - planted xfail",
        "PASSED test_mixed.py::test_passes",
    ):
        assert line in out.stdout, line
    assert "SKIPPED [1] test_mixed.py:7: planted skip in a lane" in out.stdout
    assert _junit(root) == {
        "test_fails": "failure",
        "test_skips": "skipped",
        "test_errors": "error",
        "test_xfails": "skipped",
        "test_passes": "passed",
        "test_dies": "failure",
        "test_after_death": "passed",
        "test_hangs": "failure",
        "test_after_hang": "passed",
    }


def test_a_lane_killed_mid_test_fails_that_test_with_its_output_and_the_rest_runs(outcomes):
    out, _ = outcomes
    failure = out.stdout.split("___ test_dies ___")[1].split("___ test_")[0]
    assert "was killed by signal SIGKILL during this test" in failure
    assert "last words of the lane" in failure
    assert "PASSED test_dies.py::test_after_death" in out.stdout


def test_a_hung_lane_is_killed_at_the_lane_timeout_with_its_stack_and_the_rest_runs(outcomes):
    out, _ = outcomes
    failure = out.stdout.split("___ test_hangs ___")[1].split("___ test_")[0]
    assert "ran longer than --lane-timeout 3s" in failure
    assert "hanging in a lane" in failure
    assert 'test_hangs.py", line 5 in test_hangs' in failure, "no Python stack of the hung test"
    assert "PASSED test_hangs.py::test_after_hang" in out.stdout


def test_lanes_that_cannot_start_fail_their_tests_with_the_reason_and_the_session_ends(tmp_path):
    """Lanes that exit before they ask for work (here their conftest fails to import in lanes only) are started
    again once per world size, then its tests fail with the output: not lanes started again without end."""
    files = {
        "conftest.py": """
import os
if os.environ.get("DISTBENCH_LANE") is not None:
    raise ImportError("planted: this lane cannot import its conftest")
""",
        "test_cannot_a.py": "def test_one(): pass\n",
        "test_cannot_b.py": "def test_two(): pass\n",
        "test_cannot_c.py": "import pytest\n@pytest.mark.world_size(2)\ndef test_pair(): pass\n",
    }
    t0 = time.monotonic()
    out = session(tmp_path, files, "--lanes", "2")
    assert out.returncode == 1, out.stdout[-3000:]
    assert time.monotonic() - t0 < 120
    for name in ("a.py::test_one", "b.py::test_two", "c.py::test_pair"):
        assert f"ERROR test_cannot_{name} - lane process" in out.stdout, out.stdout[-3000:]
    assert "planted: this lane cannot import its conftest" in out.stdout
    assert "before it could run a test" in out.stdout
    started = re.search(r"lanes: (\d+) started", out.stdout)
    # per world size: the lanes started at once (two of world size 1 here), and one more try
    assert started and int(started.group(1)) <= 5, out.stdout[-2000:]


def test_a_lane_whose_test_left_a_thread_running_still_ends(tmp_path):
    """A lane leaves as soon as its work and report are done (LaneReporter.close): not after the threads its
    tests or their libraries left, which Python's exit would wait for. Here a thread that runs for 60 s; the
    whole session takes a few seconds."""
    files = {
        "test_thread.py": """
import threading, time
def test_leaves_a_thread():
    threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
def test_other(): pass
""",
        "test_more.py": "def test_more(): pass\n",
    }
    t0 = time.monotonic()
    out = session(tmp_path, files, "--lanes", "2")
    took = time.monotonic() - t0
    assert out.returncode == 0 and "3 passed" in out.stdout, out.stdout[-3000:]
    assert took < 45, f"the session waited {took:.0f} s for a lane's leftover thread"


GPU_CASES = """
import pytest

@pytest.mark.gpu
@pytest.mark.strategies("ddp", "zero3")
def test_parity(strategy, world_size):
    pass

def test_cpu():
    pass
"""


def test_auto_turns_lanes_on_when_two_lanes_would_run_at_once(pytester, monkeypatch):
    import distbench.testsuite.plugin as plugin

    gpus = {"n": 4}
    monkeypatch.setattr(plugin, "cuda_device_count", lambda: gpus["n"])
    monkeypatch.setattr(plugin, "_gpu_memory_bytes", lambda: 141 * 2**30)
    # GPT-2 124M's estimate, without building the model here: pytester's in-process session drops the modules it
    # imported afterwards, and torch._dynamo (which transformers' models import) cannot be imported twice
    monkeypatch.setattr(plugin, "_rank_peak_estimate", lambda config, cases, peaks: 5 * 2**30)
    monkeypatch.setattr(plugin.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    pytester.makeconftest("pytest_plugins = ['distbench.testsuite.plugin']")
    pytester.makepyfile(test_cases=GPU_CASES, test_more="def test_other():\n    pass\n")
    items, _ = pytester.inline_genitems("-m", "gpu or not gpu", "--world-sizes", "1,2")
    gpu_items = [it for it in items if "gpu" in it.nodeid]
    config = items[0].config

    def lanes(n: int, selected: list[pytest.Item], mode: str | int = "auto", per: str | int = "auto") -> Any:
        gpus["n"] = n
        monkeypatch.setitem(config.stash[plugin.OPTIONS], "lanes", mode)
        monkeypatch.setitem(config.stash[plugin.OPTIONS], "lanes_per_device", per)
        decision = plugin._lane_plan(SimpleNamespace(items=selected, config=config))  # type: ignore[arg-type]
        return None if decision is None else (decision[0].seats, decision[0].lanes_at_once)

    # GPT-2 124M ranks fit many times in an H200's memory; 16 host cores allow 8 ranks in all on one GPU (2
    # cores a rank), 12 on two (4/3 cores a rank: schedule.SEAT_CORES_PER_RANK_MULTI_GPU)
    assert lanes(1, gpu_items) == (8, 2)  # one GPU: the two ws1 units share it; ws2 cannot run
    assert lanes(2, gpu_items) == (6, 2)
    assert lanes(4, gpu_items, per=1) == (1, 2)
    assert lanes(2, [it for it in gpu_items if "ddp" in it.nodeid and "ws1" in it.nodeid]) is None
    assert lanes(1, gpu_items, per=1) is None  # one seat on one GPU: nothing runs beside anything
    assert lanes(2, gpu_items, "off") is None
    with pytest.raises(pytest.exit.Exception, match="this machine has 2 CUDA devices"):
        lanes(2, gpu_items, 3)
    cpu_items = [it for it in items if "gpu" not in it.nodeid]
    assert lanes(2, cpu_items) is None  # the CPU tier: off unless asked for (docs: measured slower)...
    assert lanes(0, cpu_items, 2) == (1, 2)  # ...on 2 CPU slots when asked, one lane per slot

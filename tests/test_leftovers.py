"""Nothing is left behind after a test session or a run, however it ends: a session with a failing and a
hanging job, a `distbench run` interrupted by Ctrl-C, and a session of lanes stopped by Ctrl-C or -x leave no
process, no distbench temp dir and no shared memory segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leftovers import TAG_ENV, new_tag, shm_entries, tagged_processes, wait_clean

pytestmark = pytest.mark.slow  # whole sessions and runs (lanes too), ended every way: ~55 s on 2 cores

TESTS = Path(__file__).parent

SESSION = """
import rank_jobs


def test_passes(suite):
    assert [r["rank"] for r in suite.run_job(2, rank_jobs.whoami)] == [0, 1]

def test_fails(suite):
    suite.run_job(2, rank_jobs.raise_in, rank=1)

def test_hangs(suite):
    suite.run_job(2, rank_jobs.hang_in, timeout=2, rank=0)
"""


def _env(tag: str, tmp: Path) -> dict[str, str]:
    path = [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, TAG_ENV: tag, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(path)}


def _ctrl_c_reaches_it() -> None:
    """The child's Ctrl-C as a terminal's: a shell that runs a job in the background (`cmd &`, as CI wrappers
    and nohup do) starts it with SIGINT ignored, and Python then keeps it ignored in this test's children."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


#: a pytest session with the suite's plugin, as a project without the suite's conftest runs it
PYTEST = [sys.executable, "-m", "pytest", "-p", "distbench.testsuite.plugin", "-p", "no:cacheprovider"]


def _dirs(tmp_path: Path) -> tuple[str, Path, Path]:
    """A tag for a session's processes, its TMPDIR and its (empty) work directory."""
    tag, tmp, work = new_tag(), tmp_path / "tmp", tmp_path / "session"
    tmp.mkdir()
    work.mkdir()
    return tag, tmp, work


def test_a_session_with_a_failing_and_a_hanging_job_leaves_nothing(tmp_path: Path):
    tag, tmp, work = _dirs(tmp_path)
    (work / "test_session.py").write_text(SESSION)
    shm = shm_entries()
    out = subprocess.run(
        [*PYTEST, "-q", "test_session.py"],
        cwd=work,
        env=_env(tag, tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "2 failed, 1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by a pytest session: {left}"


def test_a_session_whose_output_closes_then_is_terminated_leaves_nothing(tmp_path: Path):
    """`timeout 60 pytest | head`: the output closes while tests run, so the session's later writes fail and
    it winds up, and the SIGTERM that follows lands in its clean-up. What the session made must be removed
    all the same: a session directory was left in this very case, SIGTERM having cut the clean-up short."""
    tag, tmp, work = _dirs(tmp_path)
    (work / "test_session.py").write_text(SESSION)
    shm = shm_entries()
    session = subprocess.Popen(
        [*PYTEST, "-v", "test_session.py"],
        cwd=work,
        env=_env(tag, tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert session.stdout is not None
    for line in session.stdout:  # as `head` reads it: until the first test has run, then the pipe is gone
        if b"PASSED" in line:
            break
    session.stdout.close()
    time.sleep(1.0)
    session.send_signal(signal.SIGTERM)
    try:
        session.wait(timeout=120)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by a session whose output pipe closed: {left}"


#: How a run is stopped: Ctrl-C at a terminal (SIGINT to the process group), or a batch system's cancel or
#: time limit (SIGTERM to the process it started: scancel, `timeout`, a CI runner's cancel).
STOPS = {
    "ctrl-c": lambda pid: os.killpg(pid, signal.SIGINT),
    "sigterm": lambda pid: os.kill(pid, signal.SIGTERM),
}
STOP_SIGNALS = {"ctrl-c": signal.SIGINT, "sigterm": signal.SIGTERM}


@pytest.mark.parametrize(
    "stop",
    ["sigterm", pytest.param("ctrl-c", marks=pytest.mark.nightly)],  # the lane session below stops on Ctrl-C
)
def test_a_stopped_run_leaves_nothing(tmp_path: Path, stop: str):
    """A run stopped while its ranks train ends within seconds and leaves nothing."""
    tag, tmp = new_tag(), tmp_path / "tmp"
    tmp.mkdir()
    shm = shm_entries()
    built = tmp_path / "built"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distbench.cli",
            "run",
            "--device",
            "cpu",
            "-s",
            "ddp",
            "-n",
            "2",
            "-m",
            "user_models:announced_lm",
            "--steps",
            "100000",
            "-o",
            str(tmp_path / "results"),
        ],
        env={**_env(tag, tmp), "BUILT_MARKER": str(built)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_ctrl_c_reaches_it,
    )
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not built.exists() and run.poll() is None:
            time.sleep(0.05)
        assert built.exists(), "the ranks never built the model"
        time.sleep(0.5)  # into the training steps
        assert tagged_processes(tag), "the run ended before it was interrupted"
        t0 = time.monotonic()
        STOPS[stop](run.pid)
        out, _ = run.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 128 + STOP_SIGNALS[stop], out[-3000:]
    # one line says what was kept; where the main thread happened to wait is no news to whoever stopped it
    assert "stopped: 0 of 1 result(s) finished" in out and "Traceback" not in out, out[-3000:]
    # side by side (the default) the run holds two pools, ddp's two ranks and the one-rank baseline, each stopped
    # in turn: 4.1 s on 2 cores beside another test session, where one pool took under 4
    assert took < 8, f"{stop} took {took:.1f}s to end the run"
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by an interrupted run: {left}\n{out[-3000:]}"


LANE_TESTS = """
import time
from pathlib import Path

import rank_jobs

def test_{name}(suite):
    assert suite.run_job(1, rank_jobs.whoami)[0]["rank"] == 0  # a pool of ranks in the lane process
    Path("started-{name}").touch()
    time.sleep(600)
"""


def _lane_session(tag: str, tmp: Path, work: Path, *args: str) -> subprocess.Popen[str]:
    """A session of two lanes (`--lanes 2`), each holding a rank pool and sleeping in a test."""
    for name in ("one", "two"):
        (work / f"test_{name}.py").write_text(LANE_TESTS.replace("{name}", name))
    return subprocess.Popen(
        [*PYTEST, "--lanes", "2", *args],
        cwd=work,
        env=_env(tag, tmp),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_ctrl_c_reaches_it,
    )


def _wait_for(paths: list[Path], proc: subprocess.Popen[str], within: float = 120.0) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and not all(p.exists() for p in paths) and proc.poll() is None:
        time.sleep(0.05)


@pytest.mark.parametrize(
    "stop",
    ["ctrl-c", pytest.param("sigterm", marks=pytest.mark.nightly)],  # the run above stops on SIGTERM
)
def test_a_stopped_lane_session_kills_every_lane_and_its_ranks(tmp_path: Path, stop: str):
    tag, tmp, work = _dirs(tmp_path)
    shm = shm_entries()
    run = _lane_session(tag, tmp, work)
    try:
        _wait_for([work / "started-one", work / "started-two"], run)
        assert (work / "started-one").exists() and (work / "started-two").exists(), "the lanes never started"
        assert len(tagged_processes(tag)) >= 5, "expected the session, two lanes and a rank each"
        STOPS[stop](run.pid)  # the lanes have sessions of their own: only the parent hears it
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    said = "SIGTERM" if stop == "sigterm" else "KeyboardInterrupt"
    assert run.returncode == 2 and said in out, out[-3000:]
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by an interrupted lane session: {left}\n{out[-3000:]}"


def test_exitfirst_stops_every_lane_and_leaves_nothing(tmp_path: Path):
    tag, tmp, work = _dirs(tmp_path)
    shm = shm_entries()
    (work / "test_zero.py").write_text(  # fails once both other lanes hold their ranks, in their tests
        "import time\nfrom pathlib import Path\n\ndef test_fails_when_the_others_run():\n"
        "    while not (Path('started-one').exists() and Path('started-two').exists()):\n        time.sleep(0.05)\n"
        "    assert False, 'first failure'\n"
    )
    run = _lane_session(tag, tmp, work, "-x", "--lanes", "3")
    try:
        out, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode == 1, out[-3000:]
    assert "stopping after 1 failures" in out and "1 failed" in out, out[-3000:]
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by a lane session stopped by -x: {left}\n{out[-3000:]}"

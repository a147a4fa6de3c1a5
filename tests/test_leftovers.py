"""Nothing is left behind after a test session or a run, however it ends: a session with a failing and a
hanging job, and a `distbench run` interrupted by Ctrl-C, leave no process, no distbench temp dir and no
shared memory segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leftovers import TAG_ENV, new_tag, shm_entries, tagged_processes, wait_clean

pytestmark = pytest.mark.slow  # whole sessions and runs, ended every way: ~30 s on 2 cores

TESTS = Path(__file__).parent

SESSION = """
def test_passes(suite):
    assert [r["rank"] for r in suite.run(2, "rank_jobs:whoami")] == [0, 1]

def test_fails(suite):
    suite.run(2, "rank_jobs:raise_in", rank=1)

def test_hangs(suite):
    suite.run(2, "rank_jobs:hang_in", timeout=2, rank=0)
"""


def _env(tag: str, tmp: Path) -> dict[str, str]:
    path = [str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, TAG_ENV: tag, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(path)}


def test_a_session_with_a_failing_and_a_hanging_job_leaves_nothing(tmp_path: Path):
    tag, tmp, work = new_tag(), tmp_path / "tmp", tmp_path / "session"
    tmp.mkdir()
    work.mkdir()
    (work / "test_session.py").write_text(SESSION)
    shm = shm_entries()
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "distbench.pytest_plugin", "-p", "no:cacheprovider",
                          "-q", "test_session.py"], cwd=work, env=_env(tag, tmp), capture_output=True, text=True,
                         timeout=300)
    assert "2 failed, 1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by a pytest session: {left}"


def test_ctrl_c_during_a_run_leaves_nothing(tmp_path: Path):
    """SIGINT to the run's process group, as a terminal's Ctrl-C sends it, while ranks train."""
    tag, tmp = new_tag(), tmp_path / "tmp"
    tmp.mkdir()
    shm = shm_entries()
    built = tmp_path / "built"
    run = subprocess.Popen([sys.executable, "-m", "distbench.cli", "run", "--device", "cpu", "-s", "ddp", "-n", "2",
                            "-m", "user_models:announced_lm", "--steps", "100000", "-o", str(tmp_path / "results")],
                           env={**_env(tag, tmp), "BUILT_MARKER": str(built)}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not built.exists() and run.poll() is None:
            time.sleep(0.05)
        assert built.exists(), "the ranks never built the model"
        time.sleep(0.5)  # into the training steps
        assert tagged_processes(tag), "the run ended before it was interrupted"
        t0 = time.monotonic()
        os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert run.returncode != 0, out[-3000:]
    assert took < 4, f"Ctrl-C took {took:.1f}s to end the run"
    left = wait_clean(tag, tmp, shm, within=10.0)
    assert not left, f"left behind by an interrupted run: {left}\n{out[-3000:]}"
